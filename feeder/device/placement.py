"""Where a session runs and where its batches go: devices, providers, placements.

Only about ONNX Runtime's providers; ``feeder.runtime`` and ``feeder.api`` use it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional

log = logging.getLogger("feeder")

# Providers that run on a CUDA device (their device_id option says which).
CUDA_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider", "NvTensorRTRTXExecutionProvider")
# The package that brings each GPU provider, for error messages.
PACKAGE_OF = {"CUDAExecutionProvider": "onnxruntime-gpu", "TensorrtExecutionProvider": "onnxruntime-gpu (and TensorRT)",
              "NvTensorRTRTXExecutionProvider": "onnxruntime-gpu"}


@dataclass(frozen=True)
class Placement:
    """Where a feed's batches go before they are run.

    ``kind`` is "cpu" or "cuda", ``index`` the device id. ``staged=True`` (only with "cpu") runs the
    device path (staging, slots, their reuse and order) with host memory standing in for the
    device: what CI and machines without a GPU test it with (``device="cpu:staged"``).
    """

    kind: str = "cpu"
    index: int = 0
    staged: bool = False

    @property
    def on_device(self) -> bool:
        """Whether batches go through the device path (staged copies into slots)."""
        return self.kind != "cpu" or self.staged

    def __str__(self) -> str:
        if self.kind == "cpu":
            return "cpu:staged" if self.staged else "cpu"
        return f"{self.kind}:{self.index}"


CPU = Placement()


def parse_device(device: Any) -> Optional[Placement]:
    """``None`` -> None (the session decides); "cpu", "cpu:staged", "cuda", "cuda:N" -> a Placement."""
    if device is None:
        return None
    if isinstance(device, Placement):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be None, 'cpu', 'cpu:staged', 'cuda' or 'cuda:N', got {type(device).__name__}")
    text = device.strip().lower()
    if text == "cpu":
        return CPU
    if text == "cpu:staged":
        return Placement("cpu", 0, staged=True)
    kind, sep, index = text.partition(":")
    if kind == "cuda" and (not sep or index.isdigit()):
        return Placement("cuda", int(index) if sep else 0)
    raise ValueError(f"device must be 'cpu', 'cpu:staged' (the device path on the CPU), 'cuda' or 'cuda:N' (N a "
                     f"device id), got {device!r}")


def available_providers() -> List[str]:
    """The execution providers the installed onnxruntime offers ([] without onnxruntime)."""
    try:
        import onnxruntime
    except ImportError:
        return []
    return list(onnxruntime.get_available_providers())


def _missing(asked: str, what: str) -> ValueError:
    have = available_providers()
    package = PACKAGE_OF.get(asked, "the onnxruntime package that has it")
    return ValueError(f"{what}: {asked} is not available in the installed onnxruntime (its providers: {have}); "
                      f"install {package} in place of onnxruntime (pip uninstall onnxruntime && "
                      f"pip install onnxruntime-gpu) on a machine with a GPU")


def check_device(placement: Placement, what: str = "device") -> None:
    """ValueError naming the available providers and the package to install when ``placement``
    needs a provider that the installed onnxruntime lacks."""
    if placement.kind == "cuda" and "CUDAExecutionProvider" not in available_providers():
        raise _missing("CUDAExecutionProvider", f"{what} {str(placement)!r}")


def providers_for(spec: Any) -> Optional[List[Any]]:
    """Providers for an InferenceSession from a short spec: None -> None (the default, see
    :func:`default_providers`); "cpu"; "cuda" or "cuda:N" (the CUDA provider on device N, the CPU
    provider for what it cannot run); or a list of provider names / (name, options) pairs, as
    ``onnxruntime.InferenceSession`` takes them. ValueError for a provider that is not installed."""
    if spec is None:
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower() == "cpu":
            return ["CPUExecutionProvider"]
        if text.lower().startswith("cuda"):
            placement = parse_device(text)
            assert placement is not None
            check_device(placement, "provider")
            return [("CUDAExecutionProvider", {"device_id": str(placement.index)}), "CPUExecutionProvider"]
        spec = [text]
    if isinstance(spec, (list, tuple)):
        providers = list(spec)
        have = available_providers()
        for p in providers:
            name = p[0] if isinstance(p, (list, tuple)) and p else p
            if not isinstance(name, str):
                raise TypeError(f"providers must be provider names or (name, options) pairs, got {p!r}")
            if name not in have:
                raise _missing(name, "providers")
        return providers
    raise TypeError(f"providers must be None, 'cpu', 'cuda', 'cuda:N' or a list of providers, "
                    f"got {type(spec).__name__}")


def default_providers() -> List[str]:
    """What a session gets when no provider is asked for: the CUDA provider (then the CPU one) when
    the installed onnxruntime has it, else the CPU provider. TensorRT only when asked for (building
    its engines takes minutes)."""
    if "CUDAExecutionProvider" in available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_placement(session: Any) -> Placement:
    """Where ``session`` runs: its first provider, and that provider's ``device_id``. Anything that
    does not say (a training adapter, a test double) runs on the CPU."""
    inner = getattr(session, "session", session)  # adapters that wrap an InferenceSession
    try:
        providers = list(inner.get_providers())
    except Exception:  # not an InferenceSession
        return CPU
    if not providers or providers[0] not in CUDA_PROVIDERS:
        return CPU
    index = 0
    try:
        index = int(inner.get_provider_options().get(providers[0], {}).get("device_id", 0))
    except Exception:  # options that do not say: device 0, as the provider assumes
        pass
    return Placement("cuda", index)


def resolve(session: Any, device: Any) -> Placement:
    """The placement of a feed of ``session`` asked for with ``device`` (see init_data_input_workers)."""
    asked = parse_device(device)
    placed = session_placement(session)
    if asked is None:
        return placed
    check_device(asked)
    if asked.kind == "cuda":
        if placed.kind != "cuda":
            raise ValueError(f"device {str(asked)!r}: the session runs on {_first_provider(session)}; create it with "
                             f"providers=['CUDAExecutionProvider', 'CPUExecutionProvider'] to run it on the GPU")
        if placed.index != asked.index:
            raise ValueError(f"device {str(asked)!r}: the session runs on cuda:{placed.index} (its provider option "
                             f"device_id); batches must go where it runs")
    return asked


def _first_provider(session: Any) -> str:
    try:
        return str(list(session.get_providers())[0])
    except Exception:
        return "the CPU"


def cuda_graph_enabled(session: Any) -> bool:
    """Whether ``session`` captures CUDA graphs (the CUDA provider's ``enable_cuda_graph``)."""
    try:
        opts = session.get_provider_options().get("CUDAExecutionProvider", {})
    except Exception:
        return False
    return str(opts.get("enable_cuda_graph", "0")).lower() in ("1", "true")
