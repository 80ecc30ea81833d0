"""MultiWorkerMirroredStrategy training with memsave: two workers on this machine.

Each worker runs the same custom training loop: ``strategy.run(step)``
inside a ``tf.function``, where ``step`` takes its gradients with
``memsave.gradients(loss, variables, checkpoints="memory")`` instead of
``tf.GradientTape``, all-reduces them across workers, and applies them.
Nothing else changes: the model, the input pipeline
(``distribute_datasets_from_function``) and the update are what a
GradientTape loop has. memsave rewrites the step's graph on each worker,
so each worker's activation memory drops.

Run it in one of two ways::

    # Launcher: picks two free loopback ports and starts both workers.
    python experiments/examples/multi_worker.py

    # Or start each worker yourself (here, or on two machines with their
    # host names in --hosts):
    python experiments/examples/multi_worker.py --worker-index 0 --ports 12345,12346 &
    python experiments/examples/multi_worker.py --worker-index 1 --ports 12345,12346

Each worker trains the same model twice from the same weights, with memsave
and with GradientTape (the losses must match), and prints its losses and the
CPU allocator's peak during the steps. About 30 s on 2 CPU cores.

Keras ``fit`` under MultiWorkerMirroredStrategy fails in Keras 3 itself
(keras-team/keras#20585), with or without memsave: use a custom loop as here.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

# Peaks are read from the CPU allocator's statistics, kept only with oneDNN
# on (off by default on CPUs without AVX-512): see experiments/allocator.py.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

MiB = 1 << 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker-index", type=int, help="run as this worker (default: launch all)")
    parser.add_argument("--ports", help="comma-separated ports, one per worker (default: free ones)")
    parser.add_argument("--hosts", default="localhost",
                        help="comma-separated hosts, one per worker, or one for all (default localhost)")
    parser.add_argument("--workers", type=int, default=2, help="workers to launch (launcher only)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument("--timeout", type=float, default=300, help="seconds (launcher only)")
    return parser.parse_args(argv)


# -- a worker ---------------------------------------------------------------------------


def run_worker(args):
    ports = args.ports.split(",")
    hosts = args.hosts.split(",")
    hosts = hosts * len(ports) if len(hosts) == 1 else hosts
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"{h}:{p}" for h, p in zip(hosts, ports)]},
        "task": {"type": "worker", "index": args.worker_index},
    })
    import numpy as np
    import tensorflow as tf

    import memsave

    # RING all-reduce over gRPC: what works on CPUs (NCCL is for GPUs).
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING))

    rs = np.random.RandomState(0)
    initial = [a for _ in range(args.layers) for a in (
        (rs.randn(args.width, args.width) / np.sqrt(args.width)).astype(np.float32),
        np.zeros(args.width, np.float32))]
    teacher = tf.constant(rs.randn(args.width, args.width) / np.sqrt(args.width), tf.float32)

    def dataset_fn(ctx):
        # Each worker makes its own part of every global batch (synthetic
        # regression data from a fixed teacher; seeded, so runs repeat).
        batch = ctx.get_per_replica_batch_size(args.global_batch)

        def make(step):
            seed = tf.stack([step, tf.cast(ctx.input_pipeline_id, tf.int64)])
            x = tf.random.stateless_normal([batch, args.width], seed=seed)
            return x, tf.tanh(tf.matmul(x, teacher))

        return tf.data.Dataset.range(args.steps).map(make)

    def model(params, x):
        h = x
        for w, b in zip(params[0::2], params[1::2]):
            h = tf.tanh(tf.matmul(h, w) + b)
        return h

    def mse(pred, y):
        # This replica's share of the mean over the global batch.
        return tf.reduce_sum(tf.square(pred - y)) / (args.global_batch * args.width)

    def train(method):
        with strategy.scope():
            params = [tf.Variable(a, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                      for a in initial]

        def replica_step(x, y):
            if method == "memsave":
                loss = mse(model(params, x), y)
                grads = memsave.gradients(loss, params, checkpoints="memory")
            else:
                with tf.GradientTape() as tape:
                    loss = mse(model(params, x), y)
                grads = tape.gradient(loss, params)
            ctx = tf.distribute.get_replica_context()
            loss, grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, (loss, grads))
            updates = [p.assign_sub(args.learning_rate * g) for p, g in zip(params, grads)]
            with tf.control_dependencies(updates):
                return tf.identity(loss)

        @tf.function
        def step(x, y):
            return strategy.run(replica_step, args=(x, y))

        losses, peaks = [], []
        for x, y in strategy.distribute_datasets_from_function(dataset_fn):
            tf.config.experimental.reset_memory_stats("CPU:0")
            loss = step(x, y)
            peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
            losses.append(float(strategy.experimental_local_results(loss)[0]))
        return losses, float(np.median(peaks[1:] or peaks))  # the first step also traces

    results = {}
    for method in ("memsave", "tape"):
        start = time.perf_counter()
        losses, peak = train(method)
        results[method] = {"losses": losses, "peak_bytes": peak,
                           "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps({"worker": args.worker_index, **results}), flush=True)


# -- the launcher -------------------------------------------------------------------------


def free_ports(n):
    """n distinct ports that were free on 127.0.0.1 a moment ago."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def launch(args):
    ports = args.ports.split(",") if args.ports else [str(p) for p in free_ports(args.workers)]
    worker_args = [
        "--ports", ",".join(ports), "--hosts", args.hosts, "--layers", str(args.layers),
        "--width", str(args.width), "--global-batch", str(args.global_batch),
        "--steps", str(args.steps), "--learning-rate", str(args.learning_rate),
    ]
    logs, procs = [], []
    start = time.monotonic()
    try:
        # Output goes to files: a worker blocked on a full pipe would stall
        # the other in its next collective.
        for i in range(len(ports)):
            logs.append(tempfile.TemporaryFile("w+"))
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker-index", str(i), *worker_args],
                stdout=logs[-1], stderr=subprocess.STDOUT,
                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))))
        while any(p.poll() is None for p in procs):
            # One worker failing leaves the others waiting for it forever.
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() - start > args.timeout:
                print(f"timed out after {args.timeout:.0f} s", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
    if any(p.returncode != 0 for p in procs):
        for i, (p, out) in enumerate(zip(procs, outputs)):
            print(f"--- worker {i} (exit {p.returncode}):\n{out[-3000:]}", file=sys.stderr)
        sys.exit(1)

    print(f"{len(procs)} workers on ports {','.join(ports)}, "
          f"{time.monotonic() - start:.0f} s in all")
    for out in outputs:
        r = json.loads(out.strip().splitlines()[-1])
        m, t = r["memsave"], r["tape"]
        print(f"worker {r['worker']}:")
        print(f"  loss memsave      {' '.join(f'{v:.5f}' for v in m['losses'])}")
        print(f"  loss GradientTape {' '.join(f'{v:.5f}' for v in t['losses'])}")
        print(f"  peak memory: GradientTape {t['peak_bytes'] / MiB:.1f} MiB, memsave "
              f"{m['peak_bytes'] / MiB:.1f} MiB ({m['peak_bytes'] / t['peak_bytes']:.2f}x)")


if __name__ == "__main__":
    cli = parse_args()
    if cli.worker_index is None:
        launch(cli)
    else:
        run_worker(cli)
