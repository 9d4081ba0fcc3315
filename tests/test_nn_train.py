"""Token mixers, the registry, TinyLM, and the MQAR training loop."""
import pytest
import torch
from torch import nn

from atlaslib.core.testing import assert_causal_mixer
from atlaslib.nn import MIXERS, TinyLM, TokenMixer, available_mixers, make_mixer, register_mixer
from atlaslib.tasks import mqar
from atlaslib.train import MQARTask, compare_mixers, format_table, mqar_accuracy, train_mqar

CH1 = ["softmax", "linear", "retnet", "mamba2", "gla"]


def test_chapter1_mixers_registered():
    assert set(CH1) <= set(available_mixers())


@pytest.mark.parametrize("name", CH1)
def test_mixer_shape_causality_and_grad(gen, name):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer(name, 24, 3, backend="chunk")
    assert_causal_mixer(mixer, torch.randn(2, 13, 24, generator=gen, requires_grad=True), 7, gen)


@pytest.mark.parametrize("name", ["linear", "retnet", "mamba2", "gla"])
def test_mixer_chunk_equals_recurrent(gen, name):
    """The mixer passes the same q, k, v and gates to every backend."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer(name, 16, 2, backend="recurrent")
    x = torch.randn(2, 21, 16, generator=gen)
    ref = mixer(x)
    mixer.backend, mixer.chunk_size = "chunk", 8
    assert torch.allclose(mixer(x), ref, atol=1e-4, rtol=1e-4)


def test_linear_mixer_is_linear_attention(gen):
    """Without conv, phi = id: the mixer is o_proj(sum_{j<=t} (q_t.k_j) v_j) per head, written out here."""
    torch.manual_seed(0)
    D, H = 12, 2
    mixer = make_mixer("linear", D, H, conv_size=0)
    x = torch.randn(1, 9, D, generator=gen)
    q, k, v = (p(x).view(1, 9, H, D // H) for p in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
    scores = torch.einsum("bthd,bjhd->bhtj", q, k).tril()
    o = torch.einsum("bhtj,bjhd->bthd", scores, v).reshape(1, 9, D)
    assert torch.allclose(mixer(x), mixer.o_proj(o), atol=1e-5)


def test_gates_and_state_sizes():
    m = make_mixer("mamba2", 32, 4)
    x = torch.randn(2, 5, 32)
    a = m.gate(x)
    assert a.shape == (2, 4, 5) and ((a > 0) & (a < 1)).all()
    g = make_mixer("gla", 32, 4, head_k_dim=6)
    a = g.gate(x)
    assert a.shape == (2, 4, 5, 6) and ((a > 0) & (a < 1)).all()
    r = make_mixer("retnet", 33, 3)
    assert torch.allclose(r.alpha, torch.tensor([1 - 2 ** -5, 1 - 2 ** -6, 1 - 2 ** -7]))
    assert make_mixer("linear", 32, 4).state_size == 4 * 8 * 8
    assert make_mixer("linear", 32, 4, normalize=True).state_size == 4 * 8 * 9
    assert g.state_size == 4 * 6 * 8
    assert make_mixer("softmax", 32, 4).state_size is None
    lm = TinyLM(50, 32, 3, "gla", 4, head_k_dim=6)
    assert lm.state_size == 3 * 4 * 6 * 8
    assert TinyLM(50, 32, 2, "softmax", 4).state_size is None


# The memory reads phi(k), which a feature map may widen: every mixer with a matrix memory sizes its state,
# per-channel gates and router to that width, and a residual memory (x + MLP(x)) refuses it.
WIDENED = ["linear", "gla", "kda", "deltanet", "ttt_linear", "titans", "omeganet", "swla", "atlas", "dla",
           "memory_caching"]


@pytest.mark.parametrize("name", WIDENED)
def test_a_widening_feature_map_sizes_the_memory(gen, name):
    import functools

    from atlaslib.core import monomial_features
    from mixer_helpers import seeded, step_through
    seeded(gen)
    D, H = 16, 2                                  # K = 8 per head, phi(k) of degree <= 2: C(10, 2) = 45
    mixer = make_mixer(name, D, H, feature_map=functools.partial(monomial_features, degree=2),
                       backend="chunk", chunk_size=1).double()
    assert mixer.feature_dim() == 45
    x = torch.randn(2, 6, D, generator=gen, dtype=torch.float64)
    y, cache = step_through(mixer, x)
    assert torch.allclose(y, mixer(x), atol=1e-10)
    if name == "memory_caching":
        return                                    # a state that grows with T
    if name in ("omeganet", "swla", "atlas"):     # the step also carries the window's last c - 1 pairs,
        assert mixer.state_size == H * 45 * (D // H) * (2 if name == "atlas" else 1)   # not counted; atlas: + S
        return
    numbers = sum(t.numel() for t in tensors_of(cache.memory)) // x.shape[0]
    assert mixer.state_size == numbers, (mixer.state_size, numbers)


def tensors_of(state):
    """Every tensor of a mixer's step state (tensors, and tuples or dicts of them)."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in state for t in tensors_of(state[key])]
    if isinstance(state, (tuple, list)):
        return [t for part in state if part is not None for t in tensors_of(part)]
    return []


@pytest.mark.parametrize("name", ["moneta", "yaad", "memora", "atlas++"])
def test_a_residual_memory_refuses_a_widening_feature_map(name):
    import functools

    from atlaslib.core import monomial_features
    with pytest.raises(ValueError, match="needs the key \\(feature\\) width to equal the value width"):
        make_mixer(name, 16, 2, feature_map=functools.partial(monomial_features, degree=2))


def test_yaad_delta_sets_where_the_threshold_starts():
    x = torch.zeros(1, 1, 16)                     # zero input: the gate is softplus(bias), its start
    for delta in (1.0, 3.0):
        mixer = make_mixer("yaad", 16, 2, delta=delta)
        assert torch.allclose(mixer.delta_gate(x), torch.full((1, 2, 1), delta))
    with pytest.raises(ValueError, match="delta must be a finite number > 0"):
        make_mixer("yaad", 16, 2, delta=0.0)


def test_normalized_linear_uses_positive_features():
    m = make_mixer("linear", 16, 2, normalize=True)
    assert m.phi(torch.tensor([-5.0])).item() > 0
    assert torch.isfinite(m(torch.randn(1, 7, 16))).all()


def test_qk_norm():
    seen = {}

    class Probe(TokenMixer):
        def mix(self, q, k, v, x):
            seen["q"], seen["k"] = q, k
            return v

    m = Probe(16, 2, qk_norm=True)
    m(torch.randn(2, 5, 16))
    assert torch.allclose(seen["q"].norm(dim=-1), torch.ones(2, 2, 5), atol=1e-5)
    assert torch.allclose(seen["k"].norm(dim=-1), torch.ones(2, 2, 5), atol=1e-5)


def test_register_from_another_module():
    @register_mixer("_test_identity")
    class Identity(TokenMixer):
        def mix(self, q, k, v, x):
            return v
    try:
        m = make_mixer("_test_identity", 8, 2, conv_size=0, head_k_dim=3, head_v_dim=5)
        assert isinstance(m, Identity) and m.state_size == 2 * 3 * 5
        assert m(torch.randn(1, 4, 8)).shape == (1, 4, 8)
        lm = TinyLM(20, 8, 2, "_test_identity", 2)
        assert lm(torch.randint(20, (3, 6))).shape == (3, 6, 20)
        with pytest.raises(ValueError, match="already registered"):
            register_mixer("_test_identity")(type("Other", (TokenMixer,), {}))
    finally:
        MIXERS.pop("_test_identity")


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown mixer 'nope'.*softmax"):
        make_mixer("nope", 8, 2)
    with pytest.raises(TypeError, match="TokenMixer subclass"):
        register_mixer("_bad")(nn.Linear)
    with pytest.raises(ValueError, match="not divisible"):
        make_mixer("linear", 10, 3)
    with pytest.raises(ValueError, match=r"\[B, T, 8\]"):
        make_mixer("linear", 8, 2)(torch.randn(2, 3, 9))
    with pytest.raises(TypeError, match="abstract"):              # mix is abstract
        TokenMixer(8, 2)
    with pytest.raises(ValueError, match="ids must be"):
        TinyLM(10, 8, 1, "linear", 2)(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="T >= 1"):
        make_mixer("linear", 8, 2)(torch.randn(2, 0, 8))


@pytest.mark.parametrize("kw, error, match", [
    (dict(n_layers=0), ValueError, "n_layers must be >= 1"), (dict(mlp_ratio=0), ValueError, "mlp_ratio"),
    (dict(vocab_size=0), ValueError, "vocab_size"), (dict(max_len=0), ValueError, "max_len"),
    (dict(n_layers=1.5), TypeError, "n_layers")])
def test_tiny_lm_sizes_are_checked(kw, error, match):
    args = dict(vocab_size=10, d_model=8, n_layers=1, mixer="linear", n_heads=2) | kw
    with pytest.raises(error, match=match):
        TinyLM(**args)


@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_tiny_lm_mlp_is_ratio_times_wider(ratio):
    """Every block's MLP is Linear(D, ratio D) then Linear(ratio D, D): hidden width ratio * D, and
    D * rD + rD + rD * D + D parameters (weights and biases), whatever ratio TinyLM is given."""
    D = 16
    lm = TinyLM(40, D, 2, "linear", 2, mlp_ratio=ratio)
    for block in lm.blocks:
        assert block.mlp.up.out_features == block.mlp.down.in_features == ratio * D
        assert sum(p.numel() for p in block.mlp.parameters()) == 2 * ratio * D * D + ratio * D + D


def test_tiny_lm_token_ids_are_checked(gen):
    lm = TinyLM(10, 8, 1, "linear", 2)
    ids = torch.randint(0, 10, (2, 4), generator=gen)
    low, high = ids.clone(), ids.clone()
    low[0, 0], high[1, 0] = -1, 10                          # one id just outside each end (column 0: step's too)
    for bad in (ids + 10, ids - 11, low, high):
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\)"):
            lm(bad)
        with pytest.raises(ValueError, match=r"ids_t must lie in \[0, 10\)"):
            lm.step(bad[:, 0])
        with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, 10\)"):
            lm.generate(bad, 1)
    for bad in (ids.float(), ids.bool(), ids.to(torch.uint8), ids.to(torch.int16), ids.tolist()):
        with pytest.raises(ValueError, match="integer tensor"):
            lm(bad)
    with pytest.raises(ValueError, match="T >= 1"):
        lm(ids[:, :0])
    with pytest.raises(TypeError, match="greedy must be True or False"):
        lm.generate(ids, 1, greedy="no")
    for t in (0.0, float("inf"), "a"):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            lm.generate(ids, 1, greedy=False, temperature=t)


class _Oracle(nn.Module):
    """Predicts the label wherever there is one and token 0 elsewhere."""

    def __init__(self, inputs, labels, vocab):
        super().__init__()
        self.inputs, self.labels, self.vocab = inputs, labels, vocab

    def forward(self, ids):
        rows = (ids[:, None, :] == self.inputs[None]).all(-1).float().argmax(1)   # find each row
        target = self.labels[rows].clamp_min(0)
        return nn.functional.one_hot(target, self.vocab).float()


def test_mqar_accuracy_counts_labelled_positions_only(gen):
    x, y = mqar(40, 32, 4, 64, seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    assert mqar_accuracy(_Oracle(x, y, 64), x, y, batch_size=7) == 1.0
    wrong = y.clone()
    wrong[y != -100] -= 1                                   # wrong everywhere it counts
    assert mqar_accuracy(_Oracle(x, wrong, 64), x, y, batch_size=7) == 0.0
    half = y.clone()
    half[:20][y[:20] != -100] -= 1                          # first 20 rows wrong
    assert mqar_accuracy(_Oracle(x, half, 64), x, y) == pytest.approx(0.5)
    for bad in (0, -1):                                     # -1 used to score nothing and return 0.0
        with pytest.raises(ValueError, match="batch_size must be >= 1"):
            mqar_accuracy(_Oracle(x, y, 64), x, y, batch_size=bad)


def test_mqar_accuracy_puts_the_model_back_in_its_mode(gen):
    """It scores in eval mode and leaves the model as it found it: a model the caller put in eval mode (to
    generate, say) must not come back in training mode, nor one in training mode in eval mode."""
    x, y = mqar(8, 16, 2, 40, seed=int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    lm = TinyLM(40, 16, 1, "linear", 2)
    for mode in (False, True, False):
        lm.train(mode)
        mqar_accuracy(lm, x, y)
        assert all(m.training is mode for m in lm.modules()), mode


class _TrainableOracle(_Oracle):
    """The oracle of the training rows, with one parameter (a shift of every logit, which changes no argmax) for
    AdamW to hold: it answers every training row right and rows it has not seen mostly wrong."""

    def __init__(self, inputs, labels, vocab):
        super().__init__(inputs, labels, vocab)
        self.shift = nn.Parameter(torch.zeros(()))

    def forward(self, ids):
        return super().forward(ids) + self.shift


def test_reported_accuracy_is_the_held_out_accuracy(gen):
    """``TrainResult.accuracy`` is ``mqar_accuracy`` on the held-out split (data[2:]), not on the training split:
    checked with a model that knows the training rows by heart, so the two splits score far apart."""
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=20, num_test=50)
    data = task.data(int(torch.randint(0, 1000, (), generator=gen)))
    model = _TrainableOracle(data[0], data[1], 40)
    held_out, train = mqar_accuracy(model, data[2], data[3]), mqar_accuracy(model, data[0], data[1])
    assert train == 1.0 and held_out < 0.5                  # the two splits tell apart
    res = train_mqar(model, data, steps=2, batch_size=4, warmup=1, progress=False)
    assert res.accuracy == held_out


def _tiny_run(seed, steps=15):
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=200, num_test=50)
    torch.manual_seed(seed)
    model = TinyLM(40, 16, 1, "linear", 2)
    return train_mqar(model, task.data(seed), steps=steps, batch_size=16, lr=1e-2, warmup=5, seed=seed,
                      progress=False)


def test_training_is_seeded_and_learns():
    a, b, c = _tiny_run(0), _tiny_run(0), _tiny_run(1)
    assert a.losses == b.losses and a.accuracy == b.accuracy
    assert a.losses != c.losses
    assert sum(a.losses[-3:]) / 3 < sum(a.losses[:3]) / 3
    assert 0.0 <= a.accuracy <= 1.0 and len(a.losses) == 15


def test_the_progress_bar_shows_on_a_terminal_and_not_in_a_log_file(capsys, monkeypatch):
    """tqdm redraws its bar with carriage returns, which a redirected stderr keeps as one long line."""
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=16, num_test=8)
    train_mqar(TinyLM(40, 16, 1, "linear", 2), task.data(0), steps=2, batch_size=4, progress=True)
    assert "train" not in capsys.readouterr().err
    import sys
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    train_mqar(TinyLM(40, 16, 1, "linear", 2), task.data(0), steps=2, batch_size=4, progress=True)
    assert "train linear" in capsys.readouterr().err


TINY_CLI = ["--num-train", "16", "--num-test", "8", "--batch-size", "4", "--d-model", "16", "--n-heads", "2",
            "--n-layers", "1", "--seq-len", "16", "--num-kv-pairs", "2", "--vocab-size", "32", "--no-progress"]


@pytest.mark.parametrize("argv, message", [
    (["--mixer", "nosuch"], "error: unknown --mixer 'nosuch'; known: atlas, "),
    (["--n-heads", "3"], "error: --d-model 16 is not divisible by --n-heads 3"),
    (["--seq-len", "8", "--num-kv-pairs", "8"], "error: seq_len=8 is too small for num_kv_pairs=8"),
    (["--steps", "0"], "error: --steps must be >= 1, got 0"),
    (["--lr", "-1"], "error: --lr must be > 0, got -1.0"),
    (["--out", "/nonexistent/l.json"], "error: --out /nonexistent/l.json: a file name in an existing folder"),
    (["--out", "/tmp"], "error: --out /tmp: a file name in an existing folder"),
])
def test_train_command_refuses_bad_arguments_in_one_line(capsys, argv, message):
    from atlaslib import train
    with pytest.raises(SystemExit) as exit_:
        train.main([*TINY_CLI, *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err.strip().splitlines()[-1], err


def test_train_command_hands_every_option_to_the_run(monkeypatch):
    """--lr, --warmup, --steps, --batch-size and --seed reach ``train_mqar`` and --dtype the model's weights (the
    tests above pass the defaults or refuse the values, so an option read and then dropped would go unseen)."""
    from atlaslib import train
    seen = {}

    def spy(model, data, **kw):
        seen.update(kw, dtypes={p.dtype for p in model.parameters()})
        return train.TrainResult(name="spy", accuracy=0.0, losses=[1.0])
    monkeypatch.setattr(train, "train_mqar", spy)
    train.main([*TINY_CLI, "--mixer", "linear", "--lr", "0.05", "--warmup", "3", "--steps", "4", "--batch-size", "8",
                "--seed", "5", "--dtype", "float64"])
    assert (seen["lr"], seen["warmup"], seen["steps"], seen["batch_size"], seen["seed"]) == (0.05, 3, 4, 8, 5)
    assert seen["dtypes"] == {torch.float64}


def test_no_warmup_is_a_schedule_that_starts_at_full_rate(capsys):
    from atlaslib import train
    res = train.main([*TINY_CLI, "--mixer", "linear", "--steps", "2", "--warmup", "0"])
    assert len(res.losses) == 2 and "linear: 1 process(es)" in capsys.readouterr().out


@pytest.mark.parametrize("kw, error", [(dict(steps=0), ValueError), (dict(steps=2.0), TypeError),
                                       (dict(batch_size=0), ValueError), (dict(warmup=-1), ValueError)])
def test_train_mqar_refuses_counts_out_of_range(kw, error):
    """Called from Python as from the command line: steps=0 divided by zero in the LR schedule."""
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=16, num_test=8)
    with pytest.raises(error, match=f"^{next(iter(kw))} must be"):
        train_mqar(TinyLM(40, 16, 1, "linear", 2), task.data(0), progress=False, **kw)


def test_compare_mixers_rows_and_table():
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=64, num_test=16)
    rows = compare_mixers(["softmax", ("linear+norm", "linear", {"normalize": True})], task, d_model=16,
                          n_layers=1, n_heads=2, steps=2, batch_size=8, progress=False)
    assert [r["mixer"] for r in rows] == ["softmax", "linear+norm"]
    assert rows[0]["state_size"] is None and rows[1]["state_size"] == 2 * 8 * 9
    text = format_table(rows, ["mixer", "state_size", "accuracy"])
    lines = text.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1      # aligned
    assert "grows with T" in lines[2] and lines[0].split() == ["mixer", "state_size", "accuracy"]


def test_compare_mixers_final_loss_is_the_end_of_training(gen):
    # final_loss is the mean of the last 20 training losses of the very run the row reports: trained
    # again here from the same seed (compare_mixers seeds each model), 30 steps, so the first 20 differ
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=64, num_test=16)
    seed = int(torch.randint(0, 1000, (), generator=gen))
    kw = dict(steps=30, batch_size=8, progress=False)
    (row,) = compare_mixers(["linear"], task, d_model=16, n_layers=1, n_heads=2, seed=seed, **kw)
    torch.manual_seed(seed)
    losses = train_mqar(TinyLM(40, 16, 1, "linear", 2), task.data(seed), seed=seed, **kw).losses
    assert row["final_loss"] == pytest.approx(sum(losses[-20:]) / 20, rel=1e-12)


def test_format_table_rounds_to_fixed_decimals_and_right_aligns():
    """Floats print with exactly ``digits`` decimals (the value rounded, not ``digits`` significant figures), and
    every cell ends under its column header's last character."""
    from atlaslib.tables import format_table
    values = [12.3456, 0.001234, 7]
    rows = [{"name": f"r{i}", "a_long_header": v} for i, v in enumerate(values)]
    lines = format_table(rows, digits=3).splitlines()
    cells = [line.split()[1] for line in lines[2:]]
    for cell, v in zip(cells[:2], values[:2]):
        assert len(cell.split(".")[1]) == 3 and float(cell) == round(v, 3), cell
    assert cells[2] == "7"
    header = lines[0]
    for column in ("name", "a_long_header"):
        end = header.index(column) + len(column)
        for line, row in zip(lines[2:], rows):
            cell = line.split()[list(row).index(column)]
            assert line[:end].endswith(cell) and line[end:end + 1] in ("", " "), (column, line)


def test_compare_mixers_in_processes_gives_the_one_thread_rows():
    # two models trained side by side in spawned processes (one thread each) against the same two
    # trained here one after the other on one thread: the same numbers, in the order asked
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=64, num_test=16)
    kw = dict(d_model=16, n_layers=1, n_heads=2, steps=3, batch_size=8, progress=False)
    mixers = ["deltanet", ("linear+norm", "linear", {"normalize": True})]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = compare_mixers(mixers, task, **kw)
    finally:
        torch.set_num_threads(threads)
    apart = compare_mixers(mixers, task, processes=2, **kw)
    assert [r["mixer"] for r in apart] == ["deltanet", "linear+norm"]
    for a, b in zip(here, apart):
        assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}


# ---- gates stay in fp32 in a bf16 model -------------------------------------------------------

@pytest.mark.parametrize("name, module, function", [
    ("mamba2", "atlaslib.nn.linear_mixers", "linear_attention"),
    ("retnet", "atlaslib.nn.linear_mixers", "linear_attention"),
    ("gated_deltanet", "atlaslib.nn.delta_mixers", "delta_rule"),
    ("omeganet", "atlaslib.nn.omega_mixers", "omega_rule"),
])
def test_a_bf16_mixer_forgets_like_its_fp32_self(monkeypatch, name, module, function):
    # A gate sigmoid(6)^(1/16) = 1 - 1.5e-4 is exactly 1.0 in bf16, and RetNet's 1 - 2^-9 and
    # beyond too: a memory meant to forget over thousands of tokens would never forget. The
    # decay the mixer actually hands to the library, multiplied over 4096 tokens:
    import importlib
    mod = importlib.import_module(module)
    real = getattr(mod, function)
    seen = []

    def spy(*args, **kw):
        seen.append(kw["log_alpha"])
        return real(*args, **kw)
    monkeypatch.setattr(mod, function, spy)
    T, decay = 4096, {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        m = make_mixer(name, 32, 8, backend="chunk")
        if hasattr(m, "gate_proj"):
            with torch.no_grad():
                m.gate_proj.weight.zero_()
                m.gate_proj.bias.fill_(6.0)
        m = m.to(dtype)
        with torch.no_grad():
            m(torch.zeros(1, T, 32, dtype=dtype))
        assert seen[-1].dtype == torch.float32                          # the log-gate is not rounded to bf16
        decay[dtype] = seen[-1].double().sum(dim=2).exp()               # prod_t alpha_t, per head
    assert decay[torch.float32].min() < 0.99                           # the fp32 memory does forget
    torch.testing.assert_close(decay[torch.bfloat16], decay[torch.float32], rtol=1e-3, atol=0)


@pytest.mark.parametrize("name, module, function, gate, proj, bias", [
    ("titans", "atlaslib.nn.miras_mixers", "miras", "theta", "theta_gate.proj", 7.0),
    ("titans", "atlaslib.nn.miras_mixers", "miras", "eta", "eta_gate.proj", 0.375),
    ("atlas", "atlaslib.nn.atlas_mixers", "atlas", "theta", "theta_proj", 7.0),
    ("atlas", "atlaslib.nn.atlas_mixers", "atlas", "eta", "eta_proj", 0.375),
    ("gated_deltanet", "atlaslib.nn.delta_mixers", "delta_rule", 3, "beta.proj", 7.0),
    ("deltanet", "atlaslib.nn.delta_mixers", "delta_rule", 3, "beta.proj", 0.375),
    ("omeganet", "atlaslib.nn.omega_mixers", "omega_rule", "gamma", "gamma_proj", 7.0),
    ("omeganet", "atlaslib.nn.omega_mixers", "omega_rule", "eta", "eta_proj", 0.375),
])
def test_a_bf16_mixer_squashes_every_gate_in_fp32(monkeypatch, name, module, function, gate, proj, bias):
    # sigmoid(7) = 1 - 9.1e-4 is exactly 1.0 in bf16 (its last step below 1 is 2^-8), so a momentum decay,
    # a step or a window gate squashed in bf16 and cast after is a different gate (1 - g off by 100%,
    # g itself by up to 2^-9): every gate the mixer hands to the library matches its fp32 self.
    import importlib
    mod = importlib.import_module(module)
    real = getattr(mod, function)
    seen = []

    def spy(*args, **kw):
        seen.append(args[gate] if isinstance(gate, int) else kw[gate])
        return real(*args, **kw)
    monkeypatch.setattr(mod, function, spy)
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        m = make_mixer(name, 32, 4, backend="chunk")
        layer = m.get_submodule(proj)
        with torch.no_grad():
            layer.weight.zero_()
            layer.bias.fill_(bias)                                  # bias exact in bf16: the same z
        m = m.to(dtype)
        with torch.no_grad():
            m(torch.zeros(1, 8, 32, dtype=dtype))
        assert seen[-1].dtype == torch.float32, dtype
        got[dtype] = seen[-1].double()
    want = got[torch.float32]
    torch.testing.assert_close(got[torch.bfloat16], want, rtol=1e-6, atol=0)
    torch.testing.assert_close(1 - got[torch.bfloat16], 1 - want, rtol=1e-4, atol=0)


def test_every_mixer_pickles_and_builds_on_the_meta_device(gen):
    """torch.save(model) pickles the classes by name (chapter 3's presets and chapter 7's cached mixers are
    made by a function, so they must still be module attributes), and a model built on the meta device
    (large-model initialisation) gets meta parameters that load a real state dict; also with Taylor
    features given explicit start coefficients (checked on the CPU, not on meta tensors)."""
    import pickle
    x = torch.randn(1, 6, 16, generator=gen)
    cases = [(name, {}) for name in available_mixers() if not name.startswith("_")]      # "_": other tests' probes
    cases += [(name, {"degree": 2, "constant": False}) for name in ("omeganet", "swla", "atlas")]
    for name, kw in cases:
        mixer = make_mixer(name, 16, 2, **kw)
        again = pickle.loads(pickle.dumps(mixer))
        with torch.no_grad():
            assert torch.equal(mixer(x), again(x)), name
        with torch.device("meta"):
            empty = make_mixer(name, 16, 2, **kw)
        assert all(p.is_meta for p in empty.parameters()), name
        empty = empty.to_empty(device="cpu")
        empty.load_state_dict(mixer.state_dict())
        with torch.no_grad():
            assert torch.equal(mixer(x), empty(x)), name
    cached = make_mixer("memory_caching", 16, 2, base="kda")
    assert type(pickle.loads(pickle.dumps(cached))) is type(cached)


def test_every_mixer_trains_under_autocast(gen):
    """torch.autocast (bf16 on the CPU) around forward and backward: the library's forms run with autocast
    off on the bf16 q, k, v they are given (autocast's per-op casts used to mix bf16 and fp32 in the delta
    rule's in-place products, to round ATLAS's fp32 states, and to return the polynomial features in fp32),
    so every mixer runs, about as far from its fp32 self as the same mixer cast to bf16 (a margin of 4x:
    Yaad's Huber switch flips with rounding; the rounded ATLAS states were 6x)."""
    import copy
    x = torch.randn(2, 20, 16, generator=gen)
    cases = [(name, {}) for name in available_mixers() if not name.startswith("_")]
    for name, kw in cases + [("omeganet", {"degree": 2}), ("swla", {"degree": 2, "poly": "monomial"})]:
        torch.manual_seed(0)
        mixer = make_mixer(name, 16, 2, **kw)
        with torch.no_grad():
            ref = mixer(x)
            cast = copy.deepcopy(mixer).to(torch.bfloat16)(x.bfloat16())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mixer(x)
        y.float().square().sum().backward()
        assert torch.isfinite(y).all(), name
        assert all(torch.isfinite(p.grad).all() for p in mixer.parameters() if p.grad is not None), name
        err, err_cast = (((o.float() - ref).norm() / ref.norm()).item() for o in (y, cast))
        assert err <= 4 * err_cast + 5e-3, (name, err, err_cast)


@pytest.mark.parametrize("name", ["titans", "deltanet"])
def test_gradient_checkpointing_gives_the_same_gradients(gen, name):
    """torch.utils.checkpoint around a mixer (the reentrant form for chapter 3's engine, whose torch.func.vjp
    refuses saved-tensor hooks, as nn.base says) recomputes the forward and gives the same gradients."""
    from torch.utils.checkpoint import checkpoint
    x = torch.randn(2, 12, 16, generator=gen)
    torch.manual_seed(0)
    mixer = make_mixer(name, 16, 2)
    modes = [True] if name == "titans" else [True, False]
    mixer(x).square().sum().backward()
    ref = {n: p.grad.clone() for n, p in mixer.named_parameters()}
    for reentrant in modes:
        mixer.zero_grad()
        checkpoint(mixer, x.requires_grad_(), use_reentrant=reentrant).square().sum().backward()
        for n, p in mixer.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-7, msg=f"{name} {n}")
    if name == "titans":
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            checkpoint(mixer, x, use_reentrant=False).square().sum().backward()
