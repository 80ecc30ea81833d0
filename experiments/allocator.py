"""Make the CPU allocator's peak count requested bytes, not pool regions.

Used by ``xla_cnn.py`` and ``applications.py`` (imported as a sibling
module: both run as scripts from this folder, like ``models.py``).

Why pre-split: with oneDNN on (the default), CPU tensors of 256 KiB and
more come from a BFCAllocator whose stats count the whole *chunk* an
allocation gets, and a chunk is split only if it is at least twice the
request or wastes 128 MiB or more. A process that never held much memory
grows its pool in regions of doubling size, so a single 150 MiB allocation
lands in a fresh 256 MiB region and is counted as 256 MiB. XLA allocates
its temporaries as one buffer (the "preallocated-temp" allocation of its
buffer assignment, see ``XLA_FLAGS='--xla_dump_to=DIR
--xla_dump_hlo_as_text'`` and ``DIR/*buffer-assignment.txt``), so under
``jit_compile=True`` every method's step peak reads as the same power of
two unless the pool was split first. Allocating and freeing one
:data:`PRESPLIT_MIB` block before anything else gives the pool one large
region; every later chunk is split off it, and the counted peak is the
requested bytes (rounded to 256 bytes).

oneDNN must be on. TensorFlow turns it on by default only on CPUs with
AVX-512 or newer vector extensions; elsewhere (an AMD EPYC without AVX-512,
for one) the CPU allocator is a plain one that keeps no statistics, and
``get_memory_info('CPU:0')`` raises "Allocator stats not available".
Every script here that measures a peak therefore sets
``TF_ENABLE_ONEDNN_OPTS=1`` (unless the environment sets it) before
TensorFlow is imported, as ``tests/conftest.py`` does for the suite; it is
also the allocator memsave's CPU memory model describes
(``memsave.memory_model.CPU_ONEDNN``).
"""

from __future__ import annotations

MiB = 1 << 20

#: Size of the block allocated (uninitialised, so its pages are never
#: touched) and freed before anything else. Larger than any step's peak
#: measured with it (ResNet50 64x64 batch 32 under XLA: 432 MiB).
PRESPLIT_MIB = 2048


def presplit_cpu_pool(mib: int = PRESPLIT_MIB) -> None:
    """Allocate and free ``mib`` MiB on the CPU so the BFC pool is one region.

    Call it first in a fresh process, before the model is built; ``mib=0``
    does nothing (to see the quantised figures).
    """
    if not mib:
        return
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError as e:
        raise RuntimeError(
            "the CPU allocator keeps no statistics (oneDNN is off): set TF_ENABLE_ONEDNN_OPTS=1 "
            "before TensorFlow is imported (see experiments/allocator.py)") from e

    tf.raw_ops.Empty(shape=[mib * MiB // 4], dtype=tf.float32, init=False)
