"""Whether torch can use the device a user named, in one line instead of torch's traceback.

A CPU build of torch asserts ("Torch not compiled with CUDA enabled") the first time a tensor
is put on ``cuda``; the commands ask here first and print the answer with its fix.
"""

from __future__ import annotations


def device_problem(device: str) -> str | None:
    """Why ``device`` cannot hold the optimized backend's tensors here, or ``None``."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a torch device: use cpu, cuda or cuda:N"
    if parsed.type != "cuda":
        return None
    if torch.version.cuda is None:
        return (
            f"--device {device}: this torch ({torch.__version__}) is built without CUDA; "
            "use --device cpu, or install a CUDA build of torch"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (parsed.index or 0) >= count:
        return (
            f"--device {device}: torch {torch.__version__} sees {count} CUDA device"
            f"{'' if count == 1 else 's'}; use --device cpu or a device that exists"
        )
    return None
