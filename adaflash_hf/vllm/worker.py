"""RPCs into vLLM's workers for the plugin: ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` (or
``--worker-extension-cls`` on ``vllm serve``) adds them, and ``llm.collective_rpc("adaflash_stats")`` calls them on
every worker between steps."""

from __future__ import annotations

WORKER_EXTENSION = "adaflash_hf.vllm.worker.AdaFlashWorkerExtension"


class AdaFlashWorkerExtension:
    """Mixed into vLLM's worker class."""

    def _adaflash_session(self):
        session = getattr(getattr(self.model_runner, "drafter", None), "adaflash", None)
        if session is None:
            raise RuntimeError(
                "AdaFlash is not drafting in this worker: expected speculative_config method 'dflash' with a drafter "
                "folder exported by `adaflash export --format dflash` (one with a length head)"
            )
        return session

    def adaflash_stats(self) -> dict:
        """Rounds, k̂ histogram, acceptance, drafter version, reloads, the cost line, recent requests."""
        return self._adaflash_session().report()

    def adaflash_reload(self) -> int:
        """Poll the publish directory now; the drafter version being served afterwards."""
        session = self._adaflash_session()
        if session.reloader is None:
            raise RuntimeError("ADAFLASH_VLLM_WEIGHTS: expected a publish directory for reloads, got none")
        session.reloader.poll()
        return session.version
