"""A small, seeded training loop for MQAR, and a recall-versus-state-size comparison.

    task = MQARTask(vocab_size=128, seq_len=64, num_kv_pairs=8)
    rows = compare_mixers(["softmax", "linear"], task)      # about 25 s per model on 2 cores
    print_table(rows)

Everything is deterministic for a fixed seed and thread count: the data come from
``atlaslib.tasks.mqar`` with fixed seeds, the model is initialised under
``torch.manual_seed(seed)`` and batches are drawn from a private generator.

On several processes or GPUs, launch this module with ``torchrun`` (no launcher of our own):

    torchrun --nproc_per_node=2 -m atlaslib.train --mixer gated_deltanet --steps 50 --out losses.json

Under ``torch.distributed`` ``train_mqar`` wraps the model in ``DistributedDataParallel``;
``batch_size`` stays the *global* batch, drawn exactly as in one process, and rank r trains
on its rows r::N, so N processes follow the loss curve of one process (up to rounding).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from .core.validation import check_int
from .nn import TinyLM, available_mixers
# Re-exported: the chapters' notebooks import the table formatters from here.
from .tables import format_table as format_table, print_table as print_table
from .tasks import mqar


@dataclass
class MQARTask:
    """MQAR sizes, plus how many training and held-out sequences to draw."""

    vocab_size: int = 128
    seq_len: int = 64
    num_kv_pairs: int = 8
    num_train: int = 20_000
    num_test: int = 1_000
    power_a: float = 0.01
    random_filler: bool = True            # filler = random tokens (Zoology); False: token 0 throughout
    #                                       (``mqar``'s random_non_queries)

    def data(self, seed: int = 0):
        """(train_x, train_y, test_x, test_y); test data use a different seed than training data."""
        kw = dict(seq_len=self.seq_len, num_kv_pairs=self.num_kv_pairs, vocab_size=self.vocab_size,
                  power_a=self.power_a, random_non_queries=self.random_filler)
        train = mqar(self.num_train, seed=2 * seed, **kw)
        test = mqar(self.num_test, seed=2 * seed + 1, **kw)
        return (*train, *test)


@dataclass
class TrainResult:
    name: str
    accuracy: float                       # held-out fraction of labelled positions predicted right
    losses: list = field(repr=False)      # training loss per step
    state_size: int | None = None         # recurrent-state numbers (None: grows with T)
    n_params: int = 0
    seconds: float = 0.0


def mqar_loss(logits, labels):
    """Cross-entropy over the labelled positions only (label -100 is ignored)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def _world():
    """(rank, world size): (0, 1) unless torch.distributed is initialised (as under torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if _world()[1] > 1:
        dist.all_reduce(t)
    return t


@torch.no_grad()
def mqar_accuracy(model, inputs, labels, batch_size: int = 256) -> float:
    """Fraction of labelled positions (label != -100) whose argmax prediction is the label.

    Under ``torch.distributed`` rank r scores the rows r::N and the counts are summed over
    ranks, so every rank returns the same number, the one a single process would. Call it
    on every rank then (a call on rank 0 alone would wait for the others forever).
    """
    check_int("batch_size", batch_size, 1)
    rank, world = _world()
    inputs, labels = inputs[rank::world], labels[rank::world]
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=labels.device)      # correct, total
    for s in range(0, len(inputs), batch_size):
        x, y = inputs[s:s + batch_size], labels[s:s + batch_size]
        mask = y != -100
        pred = model(x).argmax(-1)
        counts += torch.stack([(pred[mask] == y[mask]).sum(), mask.sum()])
    model.train(was_training)
    correct, total = _all_reduce_sum(counts).tolist()
    return correct / max(total, 1)


def train_mqar(model, data, *, steps: int = 500, batch_size: int = 32, lr: float = 1e-2,
               weight_decay: float = 0.1, warmup: int = 50, seed: int = 0, progress: bool = True,
               name: str | None = None) -> TrainResult:
    """Train ``model`` on MQAR with AdamW and evaluate it. The learning rate is ``lr`` times a cosine over all
    ``steps`` (1 at step 0, 0 at the end) times a linear ramp over the first ``warmup`` steps, so its peak,
    at the end of the ramp, is a little below ``lr`` (0.98 lr for 50 of 500 steps).

    ``data`` is ``(train_x, train_y, test_x, test_y)`` as returned by ``MQARTask.data``.
    Returns a ``TrainResult`` with the loss per step and the held-out accuracy.

    Under ``torch.distributed`` (e.g. ``torchrun``) with N processes the model is wrapped in
    ``DistributedDataParallel``. ``batch_size`` is the GLOBAL batch and must be divisible by N:
    every rank draws the same ``batch_size`` indices as one process would and trains on its
    rows r::N. The loss is the sum of cross-entropies over the rank's labelled positions
    divided by the labelled positions of the whole global batch (times N, since DDP averages
    gradients over ranks), so the averaged gradient is that of one process on the global
    batch. ``losses`` holds the global loss (summed over ranks) on every rank; the accuracy
    is the same on every rank; only rank 0 shows a progress bar. The caller puts the model
    and data on the rank's device.
    """
    check_int("steps", steps, 1)
    check_int("batch_size", batch_size, 1)
    check_int("warmup", warmup, 0)
    rank, world = _world()
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} is the global batch and must be divisible by the "
                         f"world size {world} (each rank trains on batch_size / world rows)")
    train_x, train_y, test_x, test_y = data
    name = name or getattr(model, "mixer_name", type(model).__name__)
    net = model
    if world > 1:
        device_ids = [train_x.device.index] if train_x.device.type == "cuda" else None
        net = DistributedDataParallel(model, device_ids=device_ids)   # copies rank 0's weights to all
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    losses = []
    start = time.perf_counter()
    model.train()
    # disable=None: a terminal or a notebook shows the bar, a log file does not (its carriage returns would
    # run the updates together on one line)
    bar = tqdm(range(steps), desc=f"train {name}", disable=None if progress and rank == 0 else True, leave=False)
    for _ in bar:
        idx = torch.randint(len(train_x), (batch_size,), generator=g)     # the global batch, same on every rank
        n_labelled = (train_y[idx] != -100).sum()                       # over the global batch
        x, y = train_x[idx[rank::world]], train_y[idx[rank::world]]
        logits = net(x)
        ce_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                                 reduction="sum")
        loss = ce_sum / n_labelled
        opt.zero_grad(set_to_none=True)
        (loss * world).backward()                       # DDP divides the summed gradients by world
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(_all_reduce_sum(loss.detach().clone()).item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    acc = mqar_accuracy(model, test_x, test_y)
    return TrainResult(name=name, accuracy=acc, losses=losses, state_size=getattr(model, "state_size", None),
                       n_params=sum(p.numel() for p in model.parameters()),
                       seconds=time.perf_counter() - start)


def compare_mixers(mixers, task: MQARTask | None = None, *, d_model: int = 64, n_layers: int = 2,
                   n_heads: int = 4, seed: int = 0, progress: bool = True, processes: int = 1,
                   **train_kw) -> list[dict]:
    """Train one TinyLM per mixer on the same MQAR data; return one row per mixer.

    ``mixers`` holds names (``"linear"``) or ``(label, name, kwargs)`` triples, e.g.
    ``("linear+norm", "linear", {"normalize": True})``. Every model starts from
    ``torch.manual_seed(seed)`` and sees the same batches. Rows have keys
    mixer, state_size, params, accuracy, final_loss (the mean training loss of the last 20 steps), seconds.

    ``processes`` > 1 trains that many models at once, each in a process of its own with one torch
    thread (no progress bars): small models use a second thread poorly, so on two cores two of them
    train in less time than one after the other on two threads. The rows are those of a one-thread run.
    """
    task = task or MQARTask()
    jobs = [(spec, task, seed, dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads),
             dict(progress=progress and processes == 1, **train_kw)) for spec in mixers]
    if processes > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        # spawn, not fork: a forked copy of a process whose OpenMP threads are running can deadlock
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=torch.set_num_threads, initargs=(1,)) as pool:
            return list(pool.map(mixer_row, jobs))
    data = task.data(seed)
    return [mixer_row(job, data) for job in jobs]


def mixer_row(job, data=None) -> dict:
    """One row of ``compare_mixers``: job = (spec, task, seed, model sizes, train_mqar's keywords)."""
    spec, task, seed, sizes, train_kw = job
    label, name, kw = (spec, spec, {}) if isinstance(spec, str) else spec
    torch.manual_seed(seed)
    model = TinyLM(task.vocab_size, sizes["d_model"], sizes["n_layers"], name, sizes["n_heads"], **kw)
    res = train_mqar(model, task.data(seed) if data is None else data, seed=seed, name=label, **train_kw)
    tail = res.losses[-20:]
    return {"mixer": label, "state_size": res.state_size, "params": res.n_params,
            "accuracy": res.accuracy, "final_loss": sum(tail) / len(tail), "seconds": res.seconds}


def _init_distributed() -> torch.device:
    """Join the process group when launched by torchrun (WORLD_SIZE set); return this rank's device.

    nccl with one GPU per rank (LOCAL_RANK) when CUDA is available, gloo on CPU otherwise.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def main(argv=None) -> TrainResult:
    """Train one TinyLM on MQAR; run it on N processes with
    ``torchrun --nproc_per_node=N -m atlaslib.train --mixer gated_deltanet --steps 50 --out losses.json``."""
    p = argparse.ArgumentParser(prog="python -m atlaslib.train", description=main.__doc__)
    p.add_argument("--mixer", default="gated_deltanet")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=32, help="GLOBAL batch, split over the ranks")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--num-kv-pairs", type=int, default=8)
    p.add_argument("--num-train", type=int, default=20_000)
    p.add_argument("--num-test", type=int, default=1_000)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--out", help="write {mixer, world_size, accuracy, losses, seconds} as JSON here (rank 0)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.mixer not in available_mixers():
        p.error(f"unknown --mixer {args.mixer!r}; known: {', '.join(available_mixers())}")
    for name in ("steps", "batch_size", "d_model", "n_layers", "n_heads", "num_train", "num_test"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.d_model % args.n_heads:
        p.error(f"--d-model {args.d_model} is not divisible by --n-heads {args.n_heads}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.out and (os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(os.path.abspath(args.out)))):
        p.error(f"--out {args.out}: a file name in an existing folder, written after training")

    device = _init_distributed()
    rank, world = _world()
    try:
        if args.batch_size % world:
            p.error(f"--batch-size {args.batch_size} is the global batch: it must be divisible by the {world} "
                    "processes")
        try:      # the task's and the model's own checks of the sizes given (e.g. seq_len against the pairs)
            task = MQARTask(args.vocab_size, args.seq_len, args.num_kv_pairs, args.num_train, args.num_test)
            data = tuple(t.to(device) for t in task.data(args.seed))
            torch.manual_seed(args.seed)                    # the same initial weights on every rank
            model = TinyLM(task.vocab_size, args.d_model, args.n_layers, args.mixer, args.n_heads)
        except ValueError as e:
            p.error(str(e))
        model = model.to(device=device, dtype=getattr(torch, args.dtype))
        res = train_mqar(model, data, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         warmup=args.warmup, seed=args.seed, progress=not args.no_progress)
        if rank == 0:
            print(f"{args.mixer}: {world} process(es), final loss {res.losses[-1]:.4f}, "
                  f"accuracy {res.accuracy:.4f}, {res.seconds:.1f} s")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"mixer": args.mixer, "world_size": world, "accuracy": res.accuracy,
                               "losses": res.losses, "seconds": res.seconds}, f)
        return res
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
