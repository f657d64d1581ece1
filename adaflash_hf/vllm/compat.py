"""A fix the plugin applies to vLLM 0.32's CPU build when it registers.

vLLM's CPU linear layers hold a oneDNN matmul handler (``vllm._custom_ops.CPUDNNLGEMMHandler``) whose ``__del__``
reads the handler's address with ``Tensor.item()``. A handler left in a reference cycle (one was, in the start of a
DFlash drafter, whose own output layer vLLM replaces by the target's) is freed by the garbage collector at whatever
allocation it runs, also while torch.compile traces the target's forward under a fake-tensor mode: ``item()`` is then dispatched to that mode, which in the
bf16 warm-up recursed until the worker died ("Fatal Python error: _Py_CheckRecursiveCall: Cannot recover from
stack overflow"; stock DFlash in bf16 dies the same way), and in other modes raises inside ``__del__`` and leaks the
handler. ``release_handlers_outside_modes`` makes the destructor read the address straight from the tensor's memory
and release it with every dispatch and function mode switched off, so a handler is released wherever it is freed.
"""

from __future__ import annotations

import ctypes


def release_handlers_outside_modes() -> bool:
    """Patch ``CPUDNNLGEMMHandler.__del__`` (idempotent); False where this vLLM build has no such class."""
    from vllm import _custom_ops as ops

    handler_class = getattr(ops, "CPUDNNLGEMMHandler", None)
    if handler_class is None:
        return False
    if getattr(handler_class.__del__, "adaflash_patched", False):
        return True

    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    def __del__(self) -> None:
        tensor = getattr(self, "handler_tensor", None)
        if tensor is None:
            return
        self.handler_tensor = None
        address = ctypes.c_int64.from_address(tensor.data_ptr()).value  # no dispatch: a plain memory read
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            self.dtor(address)

    __del__.adaflash_patched = True
    handler_class.__del__ = __del__
    return True
