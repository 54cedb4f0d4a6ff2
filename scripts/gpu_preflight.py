"""What the GPU machine offers sonar-fx: versions, the GPU, the torch APIs the pass relies on, the kernels.

    python scripts/gpu_preflight.py      # first stage of scripts/gpu_check.sh

It only reports (one line per fact); it never fails on a missing piece, so the log says what was
missing rather than where the first later stage broke.
"""

from __future__ import annotations

import importlib
import platform

import torch


def main() -> None:
    print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print("gpu", props.name, f"cc {props.major}.{props.minor}", f"{props.total_memory / 2**30:.0f} GiB")
    else:
        print("gpu: none visible to torch")
    for name in ("triton", "transformers", "quack", "cutlass", "scattermoe"):
        try:
            print(name, getattr(importlib.import_module(name), "__version__", "?"))
        except Exception as err:  # a report, not a check: say what failed and go on
            print(name, "-", type(err).__name__, str(err)[:200])
    # The compiled pass uses these (sonar_fx/backend.py, passes/); all exist in torch 2.13.
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch._inductor.custom_graph_pass as custom_graph_pass

    apis = {
        "torch.library.custom_op": hasattr(torch.library, "custom_op"),
        "torch._grouped_mm": hasattr(torch, "_grouped_mm"),
        "inductor config custom_partitioner_fn": hasattr(inductor_config, "custom_partitioner_fn"),
        "custom_graph_pass.CustomPartitionerFn": hasattr(custom_graph_pass, "CustomPartitionerFn"),
        "functorch config force_non_lazy_backward_lowering": hasattr(
            functorch_config, "force_non_lazy_backward_lowering"
        ),
    }
    for api, present in apis.items():
        print(f"api {api}: {'yes' if present else 'MISSING'}")
    from sonar_fx.experts.kernels.scattermoe import fp32_matmul_precision, implementation

    print(f"sonar_fx imports; scattermoe kernels: {implementation()}, fp32 matmul {fp32_matmul_precision()}")
    try:
        importlib.import_module("sonicmoe.functional")
        print("sonicmoe.functional imports")
    except Exception as err:
        print("sonicmoe.functional FAILS:", type(err).__name__, str(err)[:300])


if __name__ == "__main__":
    main()
