"""``target_pass``: the one forward that gives drafter training the target's tapped hidden states and top-k, for the
corpus builder's greedy loop, its feature rebuild, the training batch's ``TargetFeatures`` and the held-out set."""

import torch

from adaflash_hf.trainers.corpus import greedy_with_features, rebuild_features
from adaflash_hf.trainers.corpus_format import load_features, load_soft_targets, stored_distribution
from adaflash_hf.trainers.target_features import TargetFeatures, sequence_features, target_pass

TOPK = 8


def test_the_greedy_loop_the_feature_rebuild_and_the_training_batch_read_identical_target_tensors(
    target_factory, drafter_factory, tmp_path
):
    target = target_factory("llama")
    layer_ids = drafter_factory(target).config.target_layer_ids  # [0, 3]: the last layer's output is normed
    prompt = [5, 9, 13, 22, 7, 41, 2]
    # One new token: the loop's single forward is over the whole prompt, so every feature position comes from it.
    responses, (greedy,), (greedy_topk,) = greedy_with_features(
        target, [prompt], layer_ids, 1, eos=None, pad=0, topk=TOPK
    )
    record = {
        "id": "chat/0",
        "domain": "chat",
        "input_ids": prompt + responses[0],
        "prompt_length": len(prompt),
    }
    rebuild_features(target, [record], tmp_path, layer_ids, topk=TOPK)
    rebuilt, rebuilt_topk = load_features(tmp_path, record, layer_ids), load_soft_targets(tmp_path, record)
    ids = torch.tensor([record["input_ids"]])
    batch, soft = TargetFeatures(target, layer_ids, soft_topk=TOPK)(ids, torch.ones_like(ids))
    n = len(record["input_ids"])

    assert torch.equal(greedy.flatten(1), rebuilt)  # [n - 1, len(layer_ids) * H] bf16
    assert torch.equal(batch[0, : n - 1].to(torch.bfloat16), rebuilt)
    # The distribution over the one response token, in the three layouts' common form: (int32 ids, fp16 log-probs).
    on_the_fly = stored_distribution(soft.ids[0, len(prompt) :], soft.logprobs[0, len(prompt) :])
    for other in (stored_distribution(*rebuilt_topk), on_the_fly):
        assert torch.equal(greedy_topk[0], other[0]) and torch.equal(greedy_topk[1], other[1])
    assert int(greedy_topk[0][0, 0]) == responses[0][0]  # greedy: the likeliest token is the one generated


def test_target_pass_taps_what_the_drafter_reads_at_inference(target_factory, drafter_factory):
    target = target_factory("qwen3")
    drafter = drafter_factory(target)
    ids = torch.tensor([[5, 9, 13, 22, 7, 41, 2, 300]])
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
    passed = target_pass(target, ids, drafter.config.target_layer_ids, logits_to_keep=0, topk=TOPK)
    assert torch.equal(passed.context_features(), drafter.context_features(hidden))
    assert passed.states.shape == (1, 8, len(drafter.config.target_layer_ids), target.config.hidden_size)
    expected = torch.log_softmax(target(ids).logits.float(), dim=-1).topk(TOPK, dim=-1)
    assert torch.equal(passed.topk_ids, expected.indices) and torch.equal(
        passed.topk_logprobs, expected.values
    )


def test_held_out_features_are_read_where_recorded_and_computed_where_not(target_factory, tmp_path):
    target = target_factory("llama")
    layer_ids = [0, 2]
    records = [
        {"id": f"math/{i}", "domain": "math", "input_ids": list(range(4 + i, 20 + 2 * i)), "prompt_length": 3}
        for i in range(2)
    ]
    rebuild_features(target, records[:1], tmp_path, layer_ids, topk=0)
    recorded, computed = sequence_features(target, records, layer_ids, tmp_path)
    assert torch.equal(recorded, load_features(tmp_path, records[0], layer_ids))
    ids = torch.tensor([records[1]["input_ids"]])
    expected = target_pass(target, ids, layer_ids).context_features()[0, :-1].to(torch.bfloat16)
    assert torch.equal(computed, expected) and len(list(tmp_path.rglob("*.safetensors"))) == 1
