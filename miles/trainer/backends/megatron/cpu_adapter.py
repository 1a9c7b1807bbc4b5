"""What megatron-core needs to run on a CPU over gloo: the one module that patches the dependency.

megatron-core targets CUDA and asks for it in a handful of places that a CPU run reaches: the
current CUDA device for buffers and rotary frequencies, CUDA streams around the gradient buffers
and the MoE token dispatcher, `device="cuda"` literals for small bookkeeping tensors (the causal
mask, the gradient norm, the optimizer's loss scale), the CUDA generator behind its RNG tracker, and
a TransformerEngine GEMM named in `moe_utils.py` that is undefined without TransformerEngine. Each
patch below names the file and the lines of the pinned release it stands in for. Nothing here
changes what megatron-core computes: every tensor it would have put on the GPU is put on the CPU,
and the torch norm it uses without Apex learns to mark its weight for sequence parallelism.

The patches are scoped: a module listed in `CPU_TORCH_MODULES` sees, in place of its global
`torch`, a stand-in whose `torch.cuda` answers for the CPU (current device "cpu", streams that do
nothing) and whose tensor factories read `device="cuda"` as the CPU; torch itself, and every other
module, is untouched. `apply()` refuses any megatron-core but the pinned one: a new release moves
these lines, and tests/unit/trainer/backends/test_megatron_adapter.py checks each one is still
where it is named, so a version bump fails there first rather than deep inside a run.

Non-goal: a GPU (nothing is patched where CUDA is available; TransformerEngine is used if installed).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import types
from dataclasses import dataclass

import torch

PINNED = "0.16.1"


@dataclass(frozen=True)
class Site:
    """One place in megatron-core that asks for CUDA: `module`'s file, the line numbers in the pinned
    release, and a piece of source on them (the test checks it is still there)."""

    module: str
    lines: tuple[int, ...]
    source: str


# Modules whose global `torch` becomes the CPU stand-in, with the CUDA calls it answers there.
CPU_TORCH_MODULES: tuple[Site, ...] = (
    Site("megatron.core.models.common.embeddings.rotary_pos_embedding", (162, 297),
         "torch.cuda.current_device()"),
    Site("megatron.core.transformer.utils", (35, 40), 'device="cuda"'),  # the default causal mask
    Site("megatron.core.distributed.distributed_data_parallel", (230,), "torch.cuda.Stream("),
    Site("megatron.core.distributed.param_and_grad_buffer", (417, 422, 529, 783, 800, 806),
         "device=torch.cuda.current_device()"),
    Site("megatron.core.optimizer.clip_grads", (90, 103, 115, 174, 207), "device='cuda'"),
    Site("megatron.core.optimizer.optimizer", (473, 481, 485, 907, 1141), "device='cuda'"),
    Site("megatron.core.transformer.moe.token_dispatcher", (445, 871, 873, 874, 895), "torch.cuda.Stream()"),
    Site("megatron.core.transformer.moe.moe_utils", (998, 1098), 'device="cuda"'),
    Site("megatron.core.transformer.moe.router", (90, 92, 169, 178, 192, 198),
         "device=torch.cuda.current_device()"),  # the router's weight, expert-bias and token-count buffers
    Site("megatron.core.utils", (631, 1207), "device=torch.cuda.current_device()"),  # the global memory buffer
    Site("megatron.core.tensor_parallel.mappings", (91, 141, 148, 181, 442), "device=torch.cuda.current_device()"),  # SP gathers
    Site("megatron.core.tensor_parallel.layers", (552, 597, 607), "device=torch.cuda.current_device()"),  # SP backward
    Site("megatron.core.pipeline_parallel.schedules", (596, 983, 2138), 'device="cuda"'),  # token counts
    Site("megatron.core.pipeline_parallel.p2p_communication", (190, 194, 198, 202, 242, 313, 321, 398),
         "device=torch.cuda.current_device()"),  # stage-to-stage shapes and buffers
)

# tensor_parallel/random.py seeds, reads and sets the CUDA generator to fork the model-parallel RNG
# streams (dropout); on a CPU those streams live in torch's CPU generator. Its two state helpers are
# replaced; its `torch.cuda.get_rng_state` / `manual_seed` calls go through the stand-in.
RNG_SITE = Site("megatron.core.tensor_parallel.random", (41, 72), "def _get_cuda_rng_state(")
RNG_TRACKER_SITE = Site("megatron.core.tensor_parallel.random", (235, 237, 238, 422), "torch.cuda.manual_seed(")

# moe_utils.py names TransformerEngine's `te_general_gemm` in a branch every MoE forward passes
# through, imported only when TransformerEngine is; without it the name must still exist (as None).
TE_GEMM_SITE = Site("megatron.core.transformer.moe.moe_utils", (1192, 1225), "te_general_gemm is not None")

# transformer/moe/token_dispatcher.py moves the alltoall dispatcher's split sizes to the host with
# moe_utils.maybe_move_tensor_to_cpu, which converts only CUDA tensors (as numpy arrays, the form
# all_to_all_single takes); on a CPU they would stay tensors and gloo's all-to-all refuses them. The
# dispatcher's name for it is replaced by one that converts host tensors the same way.
DISPATCH_SPLITS_SITE = Site("megatron.core.transformer.moe.token_dispatcher", (876, 879, 882, 885, 888, 892),
                            "maybe_move_tensor_to_cpu(")

# transformer/torch_norm.py (WrappedTorchNorm.__new__, the norm of the local layers without Apex or
# TransformerEngine) refuses sequence parallelism only because it does not mark its weight as
# sequence-parallel, so finalize_model_grads would not sum its gradient over the TP ranks. The
# stand-in builds the same torch norm and marks the weight.
NORM_SITE = Site("megatron.core.transformer.torch_norm", (32,),
                 'assert not config.sequence_parallel, f"sequence parallel not supported by torch LayerNorm"')

# models/common/language_module/language_module.py (setup_embeddings_and_output_layer) moves the
# tied embedding of the first and last pipeline stages to the GPU with `Tensor.cuda()` before
# all-reducing it: a tensor method, so it is stood in for only while the model is built.
TIED_EMBEDDING_SITE = Site("megatron.core.models.common.language_module.language_module", (244,),
                           "weight.data = weight.data.cuda()")

# models/common/embeddings/rope_utils.py (get_pos_emb_on_this_cp_rank, lines 63–64) builds the index of
# a context-parallel rank's two chunks in pinned host memory and moves it to the GPU; the rotary
# embedding imports it by name, so its name there is replaced by the same selection on the table's
# own device.
ROPE_CP_SITE = Site("megatron.core.models.common.embeddings.rope_utils", (63, 64), "pin_memory=True")
ROPE_CP_USER = "megatron.core.models.common.embeddings.rotary_pos_embedding"

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")


class _CpuStream:
    """A CUDA stream that is the CPU's one, in-order stream."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> "_CpuStream":
        return self  # an event on the one stream is already complete: its synchronize() returns at once


class _CpuCuda(types.SimpleNamespace):
    """`torch.cuda` as the CPU answers it."""

    def __init__(self):
        super().__init__(
            current_device=lambda: torch.device("cpu"), Stream=_CpuStream, current_stream=_CpuStream,
            default_stream=_CpuStream, stream=lambda s=None: contextlib.nullcontext(),
            synchronize=lambda *a, **k: None, empty_cache=lambda: None, is_available=lambda: False,
            get_rng_state=lambda *a, **k: torch.get_rng_state(),
            set_rng_state=lambda state, *a, **k: torch.set_rng_state(state), manual_seed=torch.manual_seed,
            nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None))

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _on_cpu(fn):
    def factory(*args, **kwargs):
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    return factory


class _CpuTorch(types.ModuleType):
    """`torch` for one megatron-core module: the same, but CUDA devices and streams are the CPU's."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


def _sequence_parallel_norm(original):
    def __new__(cls, config, *args, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm
    return staticmethod(__new__)


def _splits_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor.cpu() if torch.is_tensor(tensor) else tensor


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    size, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
    chunks = chunks.index_select(seq_dim, index)
    return chunks.view(*chunks.shape[:seq_dim], -1, *chunks.shape[seq_dim + 2:])


def _cpu_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def building_on_cpu():
    """While megatron-core builds a model on a CPU: `Tensor.cuda()` leaves the tensor where it is."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


class AdapterError(RuntimeError):
    pass


def installed_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_version() -> None:
    version = installed_version()
    if version != PINNED:
        raise AdapterError(f"the Megatron backend's CPU adapter is written against megatron-core {PINNED}, but "
                           f"{version} is installed: install megatron-core=={PINNED} (pip install -e '.[test]'), "
                           "or check each site in miles/trainer/backends/megatron/cpu_adapter.py against the new "
                           "release and move PINNED")


_applied = False


def apply() -> None:
    """Make megatron-core run on the CPU (idempotent). Raises AdapterError on any other release."""
    global _applied
    if _applied:
        return
    check_version()
    cpu_torch = _CpuTorch()
    for site in CPU_TORCH_MODULES + (RNG_TRACKER_SITE,):
        importlib.import_module(site.module).torch = cpu_torch
    rng = importlib.import_module(RNG_SITE.module)
    rng._get_cuda_rng_state, rng._set_cuda_rng_state = _cpu_rng_state, _set_cpu_rng_state
    norm = importlib.import_module(NORM_SITE.module).WrappedTorchNorm
    norm.__new__ = _sequence_parallel_norm(norm.__new__)
    importlib.import_module(DISPATCH_SPLITS_SITE.module).maybe_move_tensor_to_cpu = _splits_to_host
    importlib.import_module(ROPE_CP_USER).get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    moe_utils = importlib.import_module(TE_GEMM_SITE.module)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _applied = True
