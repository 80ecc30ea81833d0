"""The memory model's settings, as one value (no TensorFlow).

Every forecast memsave makes (the simulator, the planners, the Plan)
depends on a few facts about the device and the runtime: how the allocator
counts a buffer, whether a weight's gradient kernel overlaps the next
gradient, which gradients Grappler folds into constants, whether gradient
values that depend only on forward values run in the forward pass. They are
fields of one frozen value, :class:`MemoryModel`, passed to
:func:`memsave.simulate.simulate` and held by a
:class:`memsave.problem.Problem`: a test or a user that wants another
setting builds another value (``dataclasses.replace(model, ...)``); nothing
is a module global to toggle.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Collection, Sequence

from memsave.errors import OptionsError

__all__ = ["Allocator", "CPU_ONEDNN", "BFC", "MemoryModel", "half_conv2d_gradient_scratch",
           "half_matmul_scratch", "onednn_takes_float16"]


@dataclasses.dataclass(frozen=True)
class Allocator:
    """How an allocator accounts for a buffer of ``n`` bytes.

    Attributes
    ----------
    name : str
    min_counted_bytes : int
        Buffers smaller than this are not counted in the reported peak.
    round_bytes : int
        Counted sizes are rounded up to a multiple of this.
    """

    name: str
    min_counted_bytes: int = 0
    round_bytes: int = 256

    def counted(self, n: int) -> int:
        """Bytes a buffer of ``n`` bytes adds to the reported ``bytes_in_use``."""
        if n < self.min_counted_bytes or n <= 0:
            return 0
        r = self.round_bytes
        return -(-n // r) * r if r > 1 else n


#: oneDNN's CPU allocator (TensorFlow's default on x86 Linux): allocations
#: under ``MklCPUAllocator::kSmallAllocationsThreshold`` = 262144 bytes go to
#: ``MklSmallSizeAllocator``, whose statistics are off
#: (``mkl_small_allocator_collect_stats = false``), so
#: ``get_memory_info('CPU:0')`` never sees them; larger ones go to a BFC
#: allocator (256-byte granularity).
CPU_ONEDNN = Allocator("CPU (oneDNN MklCPUAllocator)", min_counted_bytes=262144, round_bytes=256)

#: The BFC allocator of GPUs (and of CPUs without oneDNN): counts every
#: allocation, rounded to 256 bytes.
BFC = Allocator("BFC", min_counted_bytes=0, round_bytes=256)


#: Largest tensor Grappler's constant folding materializes
#: (``ConstantFolding``'s ``max_constant_size_in_bytes``, 10 MiB). The seed
#: gradient ``ones_like(y)`` of a y with a static shape is a constant, and so
#: is every gradient computed from constants only (e.g. ``reduce_mean``'s: it
#: reads no forward value, only its constant axes): Grappler folds them into
#: Const nodes, whose tensors are allocated when the kernels are created (the
#: first call) and stay resident. Measured: a mean over a [2048, 512] float32
#: leaves 4 MiB more in use after the first call, in a tf.function and in a
#: Session; over [8192, 512] (16 MiB) nothing.
CONSTANT_FOLDING_MAX_BYTES = 10 * 1024 * 1024

#: How many of the following instructions that write a buffer still see the
#: reads of an op's gradient alive, when that gradient goes both to a weight
#: (an x or its read) and on to another op (a convolution's or matmul's).
#: Its kernels are independent and the executor runs them side by side
#: (inter-op threads): the input's gradient is consumed at once by the next
#: op's gradient, while the weight's kernel (Conv2DBackpropFilter, the
#: MatMul of x^T and dy), which nothing waits for, still reads the layer's
#: input and the incoming gradient. Measured with step stats (the zoo U-Net
#: at batch 32, 2 cores; plain and checkpointed): the concat's gradient (two
#: Slices, 3 MiB) was allocated while Conv2DBackpropFilter still held the
#: 3 MiB concat and the 1 MiB incoming gradient, and the allocator's peak
#: was there. The overlap is one kernel: a next gradient that writes several
#: new buffers (a concat's, one Slice per input) overlaps it with the first
#: (the largest) only. Not under XLA (one thunk at a time). 0 turns it off.
WEIGHT_GRADIENT_OVERLAP = 1


#: Working set TensorFlow's CPU convolution gradient kernels size their
#: im2col buffer for (``Conv2DCustomBackpropInputOp`` and
#: ``Conv2DCustomBackpropFilterOp``: "30MB is from ivybridge", an L3 cache),
#: and the per-thread work under which the input gradient shards images
#: instead of splitting one contraction (an L2 cache, 256 KiB).
CONV_GRADIENT_L3_BYTES = 30 << 20
CONV_GRADIENT_L2_BYTES = 256 << 10


def half_conv2d_gradient_scratch(input_shape: Sequence[int], filter_shape: Sequence[int],
                                 output_shape: Sequence[int], *, input_gradient: bool,
                                 filter_gradient: bool, threads: int, itemsize: int = 2) -> tuple[int, ...]:
    """Bytes of the im2col buffers of a float16 ``Conv2D``'s gradient kernels on a CPU.

    Where oneDNN does not take float16 (a CPU without AVX512-FP16: TensorFlow
    logs "oneDNN supports DT_HALF only on platforms with AVX-512"), the
    gradients of a float16 ``Conv2D`` run TensorFlow's own kernels, which
    shard the batch into groups of images sized to a 30 MiB working set
    (:data:`CONV_GRADIENT_L3_BYTES`) and allocate one im2col buffer for a
    whole group, whatever the batch: ``ceil(L3 / itemsize / work) *
    out_positions * kh * kw * in_channels`` elements, ``work`` being the
    elements of one image's three matrices. The input's gradient uses one
    image's buffer when a thread's share of that work reaches
    :data:`CONV_GRADIENT_L2_BYTES` (or the batch is 1). Measured (allocator
    records of keras.applications MobileNetV2 64x64 batch 32 under
    ``mixed_float16``): block_2_project's two gradient kernels each held a
    23.84 MiB buffer, side by side, as computed here; float32 runs oneDNN's
    kernels, which hold no such buffer.

    Shapes are NHWC (the only layout these kernels take); returns one size per
    kernel that runs (input gradient, filter gradient).
    """
    batch, out_h, out_w, out_c = output_shape
    kh, kw, in_c = filter_shape[0], filter_shape[1], filter_shape[2]
    del input_shape  # the output's positions and the filter say it all
    positions, patch = out_h * out_w, kh * kw * in_c
    work = positions * out_c + patch * out_c + positions * patch
    images = math.ceil(CONV_GRADIENT_L3_BYTES // itemsize / work)
    found = []
    if input_gradient:
        parallel = batch == 1 or work // max(threads, 1) >= CONV_GRADIENT_L2_BYTES // itemsize
        found.append((1 if parallel else images) * positions * patch * itemsize)
    if filter_gradient:
        found.append(images * positions * patch * itemsize)
    return tuple(found)


def half_matmul_scratch(a_bytes: int, b_bytes: int, out_bytes: int) -> tuple[int, ...]:
    """Bytes of the float32 temporaries of a float16 ``MatMul`` on a CPU without oneDNN.

    TensorFlow's kernel converts both operands to float32, multiplies them
    into a float32 result and converts that back: three temporaries of
    twice the float16 bytes, held while the kernel runs. Measured
    (allocator records, a tanh chain of [2048, 256] x [256, 256] float16
    products): ``x^T dy`` held two 2 MiB and one 0.25 MiB float32
    temporaries, ``dy w^T`` 2, 0.25 and 2 MiB, side by side.
    """
    return tuple(2 * n for n in (a_bytes, b_bytes, out_bytes))


def cpu_threads() -> int:
    """Threads TensorFlow's CPU kernels shard their work over (the CPUs this process may use)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def onednn_takes_float16(flags: Collection[str] | None = None) -> bool:
    """Whether oneDNN runs float16 kernels on a CPU with these feature flags.

    TensorFlow's ``IsDataTypeSupportedByOneDNNOnThisCPU(DT_HALF)``: AVX512BW
    with AVX512-FP16 or AMX-FP16, or AVX-NE-CONVERT. ``flags`` are Linux's
    names (``/proc/cpuinfo``); None reads this machine's, and where they
    cannot be read (not Linux) answers False: the forecast then counts the
    float16 kernels' scratch, the larger answer.
    """
    if flags is None:
        flags = _cpu_flags()
    flags = set(flags)
    return ("avx512bw" in flags and bool({"avx512_fp16", "amx_fp16"} & flags)) \
        or "avx_ne_convert" in flags


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """The settings of the memory model (see the module docstring).

    Attributes
    ----------
    allocator : Allocator
        Whose peak to forecast: :data:`CPU_ONEDNN` on a CPU (it does not
        report buffers under 256 KiB), :data:`BFC` on a GPU.
    weight_gradient_overlap : int
        See :data:`WEIGHT_GRADIENT_OVERLAP`.
    constant_folding_max_bytes : int
        See :data:`CONSTANT_FOLDING_MAX_BYTES`.
    early_gradient_values : bool
        Whether gradient values computed from an op's values alone
        (``GradientUse.early_bytes``: Erfc's ``square(x)``, Square's ``2 *
        x``) are placed in the forward pass, right after the op, where
        allocator records show the executor runs them. Off (the default):
        what they are computed from is kept until the gradient instead.
        Measured with it on: the Keras Transformer's forecast went from
        -19.5% to -15.8%, but chains ending in ``reduce_mean(square(h))``
        from about +1% to +20% (the early ``2 * h`` was counted beside
        ``square(h)``, which the executor frees before it runs the early
        op: the order of ready ops is not modelled).
    xla_update_in_step : bool or None
        For a step compiled by XLA (``jit_compile=True``, see
        :mod:`memsave.xla`): whether the compiled function also applies each
        gradient to its variable as soon as the gradient exists (an
        optimizer's update inside it, as in Keras ``fit`` and most custom
        loops). XLA then frees each weight's gradient once its update has
        read it: the forecast counts the xs' gradients as consumed when
        written (``gradients_kept=False`` of :func:`memsave.simulate.simulate`;
        memsave's ordered steps hold a step's weight gradients to the step's
        end, not counted). False: a compiled function that returns its
        gradients, or whose updates wait for all of them. None (the
        default): True, but False in a graph that computes in float16
        (:meth:`memsave.graph.ForwardGraph.computes_in_float16`): training
        in float16 needs a loss scale, and its finite check holds every
        update to the step's end (keras.applications MobileNetV2,
        ``mixed_float16``, loss-scaled SGD, 64x64, batch 32, 'memory': the
        forecast went from 21.7% to 13.1% under the measured peak, the
        same plan). Not read without XLA.
    float16_without_onednn : bool or None
        Whether float16 kernels run without oneDNN, as on a CPU without
        AVX512-FP16 (TensorFlow logs "oneDNN supports DT_HALF only on
        platforms with AVX-512"): a ``Conv2D``'s gradient kernels then hold
        im2col buffers of up to 30 MiB (:func:`half_conv2d_gradient_scratch`)
        and a ``MatMul`` computes in float32 copies of its operands and
        result (:func:`half_matmul_scratch`). None (the default): on the CPU
        allocator (:data:`CPU_ONEDNN`) of a CPU whose features oneDNN
        does not run float16 on (:func:`onednn_takes_float16`). Measured
        on a CPU with AVX512-FP16 (tests/test_mixed_precision.py's float16
        conv net): no buffer, and counting them forecast tf.gradients' step
        at 3.3x its measured peak. Not read under XLA, which compiles its
        own kernels.
    """

    allocator: Allocator = CPU_ONEDNN
    weight_gradient_overlap: int = WEIGHT_GRADIENT_OVERLAP
    constant_folding_max_bytes: int = CONSTANT_FOLDING_MAX_BYTES
    early_gradient_values: bool = False
    xla_update_in_step: bool | None = None
    float16_without_onednn: bool | None = None

    @property
    def runs_float16_without_onednn(self) -> bool:
        """:attr:`float16_without_onednn`, its default resolved."""
        if self.float16_without_onednn is None:
            return self.allocator == CPU_ONEDNN and not onednn_takes_float16()
        return self.float16_without_onednn

    def xla_updates_consume_gradients(self, computes_in_float16: bool) -> bool:
        """:attr:`xla_update_in_step`, its default resolved for a graph that
        does or does not compute in float16."""
        if self.xla_update_in_step is None:
            return not computes_in_float16
        return self.xla_update_in_step

    def __post_init__(self) -> None:
        if self.weight_gradient_overlap < 0:
            raise OptionsError(
                f"memsave.MemoryModel: weight_gradient_overlap={self.weight_gradient_overlap}; "
                "pass 0 (no overlap) or a positive number of instructions")

    def counting_every_byte(self) -> MemoryModel:
        """This model with the :data:`BFC` allocator, which counts every buffer.

        Planners compare plans with it: a buffer the device's allocator does
        not report (oneDNN's small allocations) still takes memory.
        """
        if self.allocator == BFC:
            return self
        return dataclasses.replace(self, allocator=BFC)
