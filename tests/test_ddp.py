"""train_mqar under torchrun + DistributedDataParallel: N processes follow one process's loss curve."""
import json
import os
import subprocess
import sys

import torch

from atlaslib.nn import TinyLM
from atlaslib.train import MQARTask, train_mqar

SIZES = dict(vocab_size=64, seq_len=32, num_kv_pairs=4, num_train=256, num_test=64)
MODEL = dict(mixer="gated_deltanet", d_model=32, n_layers=2, n_heads=2)
TRAIN = dict(steps=20, batch_size=16, lr=1e-2, warmup=5)


def _torchrun(tmp_path, nproc, seed, **overrides):
    """Run ``torchrun --standalone --nproc_per_node=nproc -m atlaslib.train`` on CPU (gloo)."""
    opts = {**SIZES, **MODEL, **TRAIN, "seed": seed, "out": str(tmp_path / "run.json"), **overrides}
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "atlaslib.train", "--no-progress", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _one_process(seed):
    """The reference: the plain loop in this process, no torch.distributed, the same global batch."""
    task = MQARTask(**SIZES)
    torch.manual_seed(seed)
    model = TinyLM(task.vocab_size, MODEL["d_model"], MODEL["n_layers"], MODEL["mixer"], MODEL["n_heads"])
    return train_mqar(model, task.data(seed), seed=seed, progress=False, **TRAIN)


def test_two_processes_follow_the_one_process_loss_curve(tmp_path, gen):
    seed = int(torch.randint(0, 1000, (), generator=gen))
    run = _torchrun(tmp_path, 2, seed)
    assert run.returncode == 0, run.stderr[-3000:]
    ddp = json.loads((tmp_path / "run.json").read_text())
    ref = _one_process(seed)
    assert ddp["world_size"] == 2 and len(ddp["losses"]) == TRAIN["steps"]
    diff = max(abs(a - b) for a, b in zip(ddp["losses"], ref.losses))
    print(f"max |loss(2 processes) - loss(1 process)| = {diff:.2e}")
    assert diff <= 1e-5
    assert ref.losses[-1] < ref.losses[0] - 0.1          # it trains, so the curve is not flat
    assert ddp["accuracy"] == ref.accuracy
    assert "accuracy" in run.stdout


def test_global_batch_not_divisible_by_world_size_raises(tmp_path):
    run = _torchrun(tmp_path, 2, 0, batch_size=7, steps=1)
    assert run.returncode != 0
    # a usage error of each rank (argparse, exit 2), before any training
    assert "error: --batch-size 7 is the global batch: it must be divisible by the 2 processes" in run.stderr
