"""A small, seeded training loop for MQAR, and a recall-versus-state-size comparison.

    task = MQARTask(vocab_size=128, seq_len=64, num_kv_pairs=8)
    rows = compare_mixers(["softmax", "linear"], task)      # about 20 s per model on 2 cores
    print_table(rows)

Everything is deterministic for a fixed seed and thread count: the data come from
``atlaslib.tasks.mqar`` with fixed seeds, the model is initialised under
``torch.manual_seed(seed)`` and batches are drawn from a private generator.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .nn import TinyLM
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

    def data(self, seed: int = 0):
        """(train_x, train_y, test_x, test_y); test data use a different seed than training data."""
        kw = dict(seq_len=self.seq_len, num_kv_pairs=self.num_kv_pairs, vocab_size=self.vocab_size,
                  power_a=self.power_a)
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


@torch.no_grad()
def mqar_accuracy(model, inputs, labels, batch_size: int = 256) -> float:
    """Fraction of labelled positions (label != -100) whose argmax prediction is the label."""
    was_training = model.training
    model.eval()
    correct, total = 0, 0
    for s in range(0, len(inputs), batch_size):
        x, y = inputs[s:s + batch_size], labels[s:s + batch_size]
        mask = y != -100
        pred = model(x).argmax(-1)
        correct += (pred[mask] == y[mask]).sum().item()
        total += mask.sum().item()
    model.train(was_training)
    return correct / max(total, 1)


def train_mqar(model, data, *, steps: int = 500, batch_size: int = 32, lr: float = 1e-2,
               weight_decay: float = 0.1, warmup: int = 50, seed: int = 0, progress: bool = True,
               name: str | None = None) -> TrainResult:
    """Train ``model`` on MQAR with AdamW (linear warm-up, cosine decay) and evaluate it.

    ``data`` is ``(train_x, train_y, test_x, test_y)`` as returned by ``MQARTask.data``.
    Returns a ``TrainResult`` with the loss per step and the held-out accuracy.
    """
    train_x, train_y, test_x, test_y = data
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    name = name or getattr(model, "mixer_name", type(model).__name__)
    losses = []
    start = time.perf_counter()
    model.train()
    bar = tqdm(range(steps), desc=f"train {name}", disable=not progress, leave=False)
    for _ in bar:
        idx = torch.randint(len(train_x), (batch_size,), generator=g)
        loss = mqar_loss(model(train_x[idx]), train_y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    acc = mqar_accuracy(model, test_x, test_y)
    return TrainResult(name=name, accuracy=acc, losses=losses, state_size=getattr(model, "state_size", None),
                       n_params=sum(p.numel() for p in model.parameters()),
                       seconds=time.perf_counter() - start)


def compare_mixers(mixers, task: MQARTask | None = None, *, d_model: int = 64, n_layers: int = 2,
                   n_heads: int = 4, seed: int = 0, progress: bool = True, **train_kw) -> list[dict]:
    """Train one TinyLM per mixer on the same MQAR data; return one row per mixer.

    ``mixers`` holds names (``"linear"``) or ``(label, name, kwargs)`` triples, e.g.
    ``("linear+norm", "linear", {"normalize": True})``. Every model starts from
    ``torch.manual_seed(seed)`` and sees the same batches. Rows have keys
    mixer, state_size, params, accuracy, final_loss, seconds.
    """
    task = task or MQARTask()
    data = task.data(seed)
    rows = []
    for spec in mixers:
        label, name, kw = (spec, spec, {}) if isinstance(spec, str) else spec
        torch.manual_seed(seed)
        model = TinyLM(task.vocab_size, d_model, n_layers, name, n_heads, **kw)
        res = train_mqar(model, data, seed=seed, progress=progress, name=label, **train_kw)
        tail = res.losses[-20:]
        rows.append({"mixer": label, "state_size": res.state_size, "params": res.n_params,
                     "accuracy": res.accuracy, "final_loss": sum(tail) / len(tail),
                     "seconds": res.seconds})
    return rows


def _fmt(x, digits):
    if x is None:
        return "grows with T"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def format_table(rows: list[dict], columns: list[str] | None = None, digits: int = 3) -> str:
    """An aligned text table of a list of dicts (floats rounded to ``digits``; None -> 'grows with T')."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[_fmt(r.get(c), digits) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_table(rows: list[dict], columns: list[str] | None = None, digits: int = 3) -> None:
    print(format_table(rows, columns, digits))
