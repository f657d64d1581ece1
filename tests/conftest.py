"""Shared fixtures and builders, everything offline: tiny random targets (Qwen3, Llama) and drafters built for them,
oracle drafters that propose a known continuation for a chosen number of rows, tiny tokenizers, the 16-token sampling
target's exact marginals and the chi-square test against them, the engine's churn driver, corpora and training
inputs, and the tiny bench generate setup. A test file imports a builder as ``from tests.conftest import name``
(pytest registers this file as ``tests.conftest`` under ``--import-mode=importlib``, so the import finds the module
pytest loaded); a fixture needs no import. No test file imports another."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Goodput's calibration is saved per machine outside tests only: a test measures its own (tests/test_cost_model.py
# turns saving on in a temporary folder).
os.environ["ADAFLASH_CACHE"] = ""

import gzip  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import adaflash_hf  # noqa: E402,F401
from adaflash_hf import AdaFlashConfig, AdaFlashDrafter  # noqa: E402

torch.set_num_threads(1)

TINY_VOCAB = 512


def tiny_qwen3_config(**overrides) -> Qwen3Config:
    values = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=None,
        pad_token_id=None,
    )
    values.update(overrides)
    return Qwen3Config(**values)


def tiny_llama_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=None,
        pad_token_id=None,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_target(kind: str = "qwen3", seed: int = 0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    config = tiny_qwen3_config(**overrides) if kind == "qwen3" else tiny_llama_config(**overrides)
    model_cls = Qwen3ForCausalLM if kind == "qwen3" else LlamaForCausalLM
    return model_cls(config).to(dtype).eval()


def make_drafter(target, seed: int = 1, **overrides) -> AdaFlashDrafter:
    torch.manual_seed(seed)
    values = dict(num_hidden_layers=2, mask_token_id=TINY_VOCAB - 1)
    values.update(overrides)
    config = AdaFlashConfig.for_target(target.config, **values)
    dtype = next(target.parameters()).dtype
    return AdaFlashDrafter(config).to(dtype).eval()


@pytest.fixture
def qwen3_target():
    return make_target("qwen3")


@pytest.fixture
def llama_target():
    return make_target("llama")


@pytest.fixture(params=["qwen3", "llama"])
def any_target(request):
    return make_target(request.param)


@pytest.fixture(scope="session")
def target_factory():
    """``target_factory(kind="qwen3"|"llama", seed=0, dtype=torch.float32, **config_overrides)``."""
    return make_target


@pytest.fixture(scope="session")
def drafter_factory():
    """``drafter_factory(target, seed=1, **AdaFlashConfig_overrides)``: a random drafter built for ``target``."""
    return make_drafter


class OracleDrafter(AdaFlashDrafter):
    """A real drafter whose block rows are overwritten so the target's lm_head proposes the reference tokens for
    exactly ``j`` rows, then a wrong token: it exercises partial acceptance and cache rollback deterministically."""

    def arm(self, reference, lm_weight, seed: int = 0, max_right: int | None = None, sharpness: float = 4.0):
        self.reference = reference[0]
        self.sharpness = sharpness
        self.lm_weight = lm_weight
        self.rng = torch.Generator().manual_seed(seed)
        self.max_right = self.config.block_size - 1 if max_right is None else max_right
        self.rights: list[int] = []
        return self

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        block = self.config.block_size
        anchor_position = int(kwargs["position_ids"][0, -block])
        right = int(torch.randint(0, self.max_right + 1, (1,), generator=self.rng))
        self.rights.append(right)
        states = out.last_hidden_state.clone()
        vocab = self.lm_weight.shape[0]
        for row in range(1, block):
            position = anchor_position + row
            if position >= self.reference.shape[0]:
                token = 0
            elif row <= right:
                token = int(self.reference[position])
            else:
                token = (int(self.reference[position]) + 1) % vocab
            states[0, row] = self.lm_weight[token] * self.sharpness
        out.last_hidden_state = states
        return out


def make_oracle(target, reference, seed=0, max_right=None, sharpness=4.0, **config):
    base = make_drafter(target, **config)
    oracle = OracleDrafter(base.config).to(next(target.parameters()).dtype).eval()
    oracle.load_state_dict(base.state_dict())
    weight = target.get_output_embeddings().weight.detach()
    logits = weight @ weight.T
    assert torch.equal(logits.argmax(-1), torch.arange(weight.shape[0])), (
        "oracle encoding needs argmax(W W^T) = id"
    )
    return oracle.arm(reference, weight, seed=seed, max_right=max_right, sharpness=sharpness)


@pytest.fixture
def watched(target_factory, drafter_factory):
    """``(target, drafter, calls)``: a tiny Qwen3 target and its drafter whose every module's forward appends the
    module's name to ``calls``, for the tests of errors that must come before any forward."""
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    calls = []
    for model in (target, drafter):
        for name, module in model.named_modules():
            module.register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    return target, drafter, calls


@pytest.fixture(scope="session")
def oracle_factory():
    """``oracle_factory(target, reference, seed=0, max_right=None)``: an OracleDrafter right for a random
    0..max_right rows of each block, then wrong, against the ``reference`` sequence."""
    return make_oracle


def make_word_tokenizer(vocab_size: int = TINY_VOCAB):
    """A tokenizer for the tiny targets whose token i is the word ``w{i}`` (0-3 are the special tokens <pad>,
    <eos>, <user>, <assistant>), with a chat template: text is words joined by spaces."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<user>", "<assistant>"]
    vocab = {w: i for i, w in enumerate(special)} | {f"w{i}": i for i in range(len(special), vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tokenizer.add_special_tokens({"additional_special_tokens": special[2:]})
    tokenizer.chat_template = "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}<assistant>"
    return tokenizer


@pytest.fixture(scope="session")
def word_tokenizer():
    """``make_word_tokenizer()``: a word-level tokenizer with a chat template for the tiny targets."""
    return make_word_tokenizer()


def tiny_tokenizer(vocab_size: int = TINY_VOCAB, eos: str = "t1") -> PreTrainedTokenizerFast:
    """A tokenizer whose token i is the word ``t{i}`` (t0 pads and stands for unknown words, ``eos`` ends a
    sequence), with a chat template that wraps each message in t2 ... t3."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    backend = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token=eos)
    tokenizer.chat_template = "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}"
    return tokenizer


# ----------------------------------------------------------------------------------------- the batched engine
class BatchedOracle(AdaFlashDrafter):
    """A real drafter whose block rows are overwritten, per batch row, so the target's lm_head proposes the
    request's greedy reference for a random 0..15 rows, then a wrong token: partial acceptance and rollback."""

    def arm(self, engine, references, lm_weight, seed=0):
        self.engine, self.references, self.lm_weight = engine, references, lm_weight
        self.rng = torch.Generator().manual_seed(seed)
        return self

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        block, vocab = self.config.block_size, self.lm_weight.shape[0]
        by_slot = {r.slot: r for r in self.engine.running}
        states = out.last_hidden_state.clone()
        for b, slot in enumerate(kwargs["cache"].batch.slots.tolist()):
            reference = self.references[by_slot[slot].request_id]
            anchor = int(kwargs["position_ids"][b, -block])
            right = int(torch.randint(0, block, (1,), generator=self.rng))
            for row in range(1, block):
                position = anchor + row
                token = int(reference[position]) if position < len(reference) else 0
                token = token if row <= right else (token + 1) % vocab
                states[b, row] = self.lm_weight[token] * 4.0
        out.last_hidden_state = states
        return out


def make_batched_oracle(target, drafter):
    """A ``BatchedOracle`` with ``drafter``'s weights (arm it with the engine and the references), and the
    target's lm_head weight it encodes tokens with."""
    oracle = BatchedOracle(drafter.config).eval()
    oracle.load_state_dict(drafter.state_dict())
    weight = target.get_output_embeddings().weight.detach()
    assert torch.equal((weight @ weight.T).argmax(-1), torch.arange(weight.shape[0]))
    return oracle, weight


def serve_with_oracle(
    target, oracle, weight, prompts, expected, indices, max_new_tokens=16, **engine_settings
):
    """``(engine, outputs)``: the ``prompts`` at ``indices`` served together by an ``AdaFlashEngine`` of ``target`` and
    the batched ``oracle`` (``make_batched_oracle``), armed with ``expected`` continuations; up to 5 running."""
    from adaflash_hf.serving import AdaFlashEngine, AdmissionConfig, SamplingParams

    engine = AdaFlashEngine(target, oracle, admission=AdmissionConfig(max_running=5), **engine_settings)
    references = {}
    oracle.arm(engine, references, weight)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    ids = {i: engine.add_request(prompts[i], params) for i in indices}
    references.update({rid: prompts[i].tolist() + expected[i] for i, rid in ids.items()})
    finished = finished_requests(engine.stream())
    return engine, [finished[ids[i]].output for i in indices]


def random_prompts(n, seed, max_len=40):
    """``n`` seeded prompts of 1..``max_len`` token ids below 500."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, 500, (k,), generator=g) for k in lengths]


def greedy_reference(target, prompt, max_new_tokens):
    """The tokens plain greedy ``target.generate`` appends to the 1-D ``prompt``."""
    return target.generate(prompt[None], max_new_tokens=max_new_tokens, do_sample=False)[
        0, len(prompt) :
    ].tolist()


def finished_requests(outputs) -> dict:
    """The requests that the final ones of ``outputs`` (an engine's step or stream) carry, by request id."""
    return {out.request_id: out.request for out in outputs if out.finished}


def run_with_churn(engine, prompts, params, seed, aborts=2, on_add=None):
    """Requests arrive at random steps, ``aborts`` of them are aborted at a random later step."""
    rng = random.Random(seed)
    arrivals = {i: rng.randint(0, 8) for i in range(len(prompts))}
    abort_at = {i: arrivals[i] + rng.randint(0, 4) for i in rng.sample(range(len(prompts)), aborts)}
    ids, step, finished = {}, 0, {}
    while len(ids) < len(prompts) or engine.has_unfinished():
        for i in [i for i, s in arrivals.items() if s == step]:
            ids[i] = engine.add_request(prompts[i], params[i])
            if on_add is not None:
                on_add(ids[i], i)
        for i in [i for i, s in abort_at.items() if s == step and ids.get(i) in engine.requests]:
            engine.abort(ids[i])
        finished |= finished_requests(engine.step())
        step += 1
    return {i: finished[rid] for i, rid in ids.items()}, set(abort_at)


def assert_outputs_equal_references(results, aborted, expected):
    """Finished requests equal their greedy reference; aborted ones a prefix of it."""
    for i, request in results.items():
        if i in aborted and request.finish_reason == "abort":
            assert request.output == expected[i][: len(request.output)]
        else:
            assert request.output == expected[i], f"request {i}"


# ----------------------------------------------------------------------------------------- sampling exactness
# A 16-token target, so the exact marginals of the first three generated tokens are computed by enumerating
# every prefix; samples are compared with them by a chi-square test per position (bins with expected count < 5
# merged, Bonferroni over the positions, family-wise level FAMILY_ALPHA).
VOCAB = 16
SCALE = 12.0
SHARPNESS = 0.5
NUM_SAMPLES = 1000
POSITIONS = 3
TEMPERATURE, TOP_K, TOP_P = 0.6, 6, 0.95
FAMILY_ALPHA = 1e-3
PROMPT = torch.tensor([[3, 9, 1, 12, 5]])


def processors() -> LogitsProcessorList:
    # The order transformers' generate uses for these three warpers.
    return LogitsProcessorList(
        [TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(top_k=TOP_K), TopPLogitsWarper(top_p=TOP_P)]
    )


def exact_marginals(target, prompt=PROMPT) -> torch.Tensor:
    """[POSITIONS, VOCAB] exact marginal law of generated positions 1..3 under the processed target distribution."""
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # every (x1, x2)
    ids = torch.cat([prompt.expand(pairs.shape[0], -1), pairs], dim=1)
    with torch.no_grad():
        logits = target(ids).logits.double()[:, -3:]
    warp = processors()
    probs = [torch.softmax(warp(ids, logits[:, i].float()).double(), -1) for i in range(3)]
    p1 = probs[0][0]
    p2_given_x1 = probs[1].view(VOCAB, VOCAB, VOCAB)[:, 0]  # rows indexed by x1
    p3_given_x1x2 = probs[2].view(VOCAB, VOCAB, VOCAB)
    m2 = p1 @ p2_given_x1
    m3 = torch.einsum("a,ab,abc->c", p1, p2_given_x1, p3_given_x1x2)
    return torch.stack([p1, m2, m3])


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    order = torch.argsort(expected, descending=True)
    observed_bins, expected_bins = [], []
    obs_acc = exp_acc = 0.0
    for index in order.tolist():
        obs_acc += float(counts[index])
        exp_acc += float(expected[index])
        if exp_acc >= 5:
            observed_bins.append(obs_acc)
            expected_bins.append(exp_acc)
            obs_acc = exp_acc = 0.0
    if exp_acc > 0 or obs_acc > 0:  # fold the small remainder into the last bin
        observed_bins[-1] += obs_acc
        expected_bins[-1] += exp_acc
    observed_t = torch.tensor(observed_bins, dtype=torch.float64)
    expected_t = torch.tensor(expected_bins, dtype=torch.float64)
    statistic = ((observed_t - expected_t) ** 2 / expected_t).sum()
    dof = len(observed_bins) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


def sample_counts(
    target, drafter, proposal: str, prompt=PROMPT, num_samples=NUM_SAMPLES, **settings
) -> torch.Tensor:
    torch.manual_seed(1234)
    config = GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=TOP_P,
        max_new_tokens=POSITIONS,
        adaflash_proposal=proposal,
        adaflash_min_len=POSITIONS,
        **settings,
    )
    counts = torch.zeros(POSITIONS, VOCAB)
    for _ in range(num_samples):
        out = target.generate(prompt, assistant_model=drafter, generation_config=config)
        tokens = out[0, prompt.shape[1] :]
        counts[torch.arange(POSITIONS), tokens] += 1
    return counts


def min_p_value(counts, marginals) -> float:
    return min(chi_square_p_value(counts[i], marginals[i]) for i in range(POSITIONS))


# ------------------------------------------------------------------------------------------- one short prompt
# A [1, 6] prompt for the generate hook's and the engine's argument checks.
SHORT_PROMPT = torch.tensor([[3, 14, 15, 92, 65, 35]])


# -------------------------------------------------------------------------------- corpora and training inputs
def rows(domains=("chat", "math"), per_domain=3):
    """Data-set rows of ``t{i}`` words, ``per_domain`` of each domain, of 3, 5, 7, ... words."""
    return [
        {
            "id": f"{d}/{i}",
            "domain": d,
            "prompt": " ".join(f"t{4 + (i * 7 + j) % 400}" for j in range(3 + 2 * i)),
        }
        for d in domains
        for i in range(per_domain)
    ]


def corpus(target, tmp_path, layer_ids, name="c", per_domain=3, max_new_tokens=24):
    """Builds a corpus of ``rows(per_domain=per_domain)`` into ``tmp_path/name`` with its features in
    ``tmp_path/name-features``; returns its records and the tokenizer."""
    from adaflash_hf.trainers.corpus import build_corpus
    from adaflash_hf.trainers.corpus_format import read_corpus

    tokenizer = tiny_tokenizer(target.config.vocab_size, eos="t511")
    build_corpus(
        target,
        tokenizer,
        rows(per_domain=per_domain),
        tmp_path / name,
        tmp_path / f"{name}-features",
        layer_ids=layer_ids,
        max_new_tokens=max_new_tokens,
    )
    return read_corpus(tmp_path / name, ["chat", "math"]), tokenizer


def corpus_with_top_k(target, tmp_path, layer_ids, topk):
    """Builds a corpus of ``rows()`` into ``tmp_path/c`` with its features (and the target's top-``topk``) in
    ``tmp_path/f``; returns its records and the tokenizer."""
    from adaflash_hf.trainers.corpus import build_corpus
    from adaflash_hf.trainers.corpus_format import read_corpus

    tokenizer = tiny_tokenizer(target.config.vocab_size, eos="t511")
    build_corpus(
        target,
        tokenizer,
        rows(),
        tmp_path / "c",
        tmp_path / "f",
        layer_ids=layer_ids,
        max_new_tokens=24,
        topk=topk,
    )
    return read_corpus(tmp_path / "c", ["chat", "math"]), tokenizer


def features_of(target, record, layer_ids):
    """The target's hidden states of ``layer_ids`` at every position of ``record`` but the last, concatenated."""
    hidden = target(torch.tensor([record["input_ids"]]), output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0, :-1] for i in layer_ids], dim=-1)


def drafts_one_token(drafter, target) -> int:
    """Zero every drafter layer's output so each MASK row drafts the same token; return it."""
    embedding, lm_weight = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        mask_row = drafter.norm(F.embedding(torch.tensor([drafter.config.mask_token_id]), embedding))
    return int((mask_row @ lm_weight.T).argmax())


def toy_batch(seq=60, prompt=10, batch=2, seed=0):
    """Random token ids and a loss mask that supervises the tokens after ``prompt``; the second row is shorter."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 500, (batch, seq), generator=g)
    loss_mask = torch.zeros(batch, seq, dtype=torch.long)
    loss_mask[:, prompt:] = 1
    loss_mask[1, seq - 7 :] = 0  # a shorter second sequence (padding)
    return input_ids, loss_mask


def repetitive_sequences(n=12, seq=48, prompt=8, seed=0):
    """A data set of ``n`` sequences of ``seq`` tokens, each a random motif of 2-4 tokens repeated, whose first
    ``prompt`` tokens are the prompt."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    # Repetitive sequences are learnable in a few steps.
    rows = []
    for _ in range(n):
        period = int(torch.randint(2, 5, (1,), generator=g))
        motif = torch.randint(0, 500, (period,), generator=g).tolist()
        tokens = (motif * seq)[:seq]
        rows.append({"input_ids": tokens, "prompt_length": prompt})
    return datasets.Dataset.from_list(rows)


def tiny_script_inputs(target, folder: Path) -> None:
    """What the training script needs on disk: ``folder/target`` (the model and a word-level tokenizer) and
    ``folder/corpus`` (8 math sequences as `adaflash corpus` writes them)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    target.save_pretrained(folder / "target")
    vocab = {f"t{i}": i for i in range(target.config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), pad_token="t0"
    )
    # A chat template, as every target the corpus serves has: the held-out twin drop tokenizes held-out prompts.
    tokenizer.chat_template = "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}"
    tokenizer.save_pretrained(folder / "target")
    (folder / "corpus").mkdir()
    with gzip.open(folder / "corpus" / "math.jsonl.gz", "wt") as handle:
        for i, row in enumerate(repetitive_sequences(n=8)):
            handle.write(json.dumps({"id": str(i), "domain": "math", **row}) + "\n")


# --------------------------------------------------------------------------------------------- bench generate
BENCH_PROMPTS = {
    "chat": [("chat-0", torch.tensor([[5, 17, 99, 3, 250, 8, 41, 77, 12]]))],
    "code": [("code-0", torch.tensor([[7, 7, 21, 300, 21, 300, 21, 300, 9, 4]]))],
}


@pytest.fixture(scope="module")
def tiny_pair(target_factory, drafter_factory):
    """A tiny Llama target and a random drafter for it, shared by a module's tests."""
    target = target_factory("llama")
    return target, drafter_factory(target)


@pytest.fixture
def offline_main(tiny_pair, tmp_path, monkeypatch):
    """main() on the tiny target: load_target, the chat template and the data sets replaced, the drafter saved."""
    from adaflash_hf.bench import generate as bench

    target, drafter = tiny_pair
    drafter.save_pretrained(tmp_path / "drafter")
    monkeypatch.setattr("adaflash_hf.assets.load_target", lambda name: (target, None))
    monkeypatch.setattr("adaflash_hf.data.prompt_ids", lambda tokenizer, row: BENCH_PROMPTS["chat"][0][1])
    monkeypatch.setattr(
        "adaflash_hf.data.load_domain",
        lambda domain, split, n=None: [{"id": f"{domain}-{i}", "prompt": "p"} for i in range(n or 8)],
    )

    def run(*extra):
        out = tmp_path / "out"
        argv = ["--quick", "--drafter", str(tmp_path / "drafter"), "--output-dir", str(out), "--threads", "1"]
        return bench.main([*argv, "--domains", "chat", "math", *extra]), out

    return run


@pytest.fixture
def no_target(monkeypatch):
    """load_target fails the test: what is checked here must be refused before the target loads."""

    def load_target(name):
        raise AssertionError("the target loaded before the options were checked")

    monkeypatch.setattr("adaflash_hf.assets.load_target", load_target)


def snapped(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` moved to 16 levels per group of 32 inputs, as a Q4_1 GGUF's dequantized weights are."""
    out, features = weight.shape
    groups = weight.reshape(out, features // 32, 32)
    for _ in range(4):  # a fixed point: the levels recomputed from the snapped group give the same group back
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        step = (high - low) / 15
        groups = low + step * torch.round((groups - low) / step)
    return groups.reshape(out, features)


def four_bit_target(target_factory, kind="llama", seed=0):
    target = target_factory(kind, seed=seed)
    output = target.get_output_embeddings()
    with torch.no_grad():
        for module in target.modules():
            if isinstance(module, torch.nn.Linear) and module is not output:
                module.weight.copy_(snapped(module.weight))
    return target
