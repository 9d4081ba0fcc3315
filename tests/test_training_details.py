"""What the mixers' front end, generation, training and the capacity helpers must do, beyond the
shapes and step-vs-forward checks of the other files: each test is written against the definition
(a documented formula or a property of it) and names, in its docstring, the plausible slip it rules out.
"""

import pytest
import torch
from torch import nn

from atlaslib.core.testing import TOLERANCE, assert_close
from atlaslib.nn import TinyLM, TokenMixer, make_mixer
from atlaslib.tasks import gd_memory, mqar, random_pairs
from atlaslib.train import MQARTask, mqar_loss, train_mqar
from mixer_helpers import seeded, step_through


# ---------------------------------------------------------------- nn: step vs forward, q/k normalisation

def test_qk_norm_comes_after_the_feature_map(gen):
    """Rules out: forward normalises q and k before phi instead of after (step keeps the documented order).
    With phi = identity (every test so far) the order does not matter; with elu+1 the mixed features
    are no longer unit vectors and step no longer reproduces forward."""
    seen = {}

    class Probe(TokenMixer):
        def mix(self, q, k, v, x):
            seen["q"], seen["k"] = q, k
            return v

    seeded(gen)
    Probe(16, 2, qk_norm=True, feature_map="elu+1")(3 * torch.randn(2, 5, 16, generator=gen))
    for name in ("q", "k"):
        assert_close(seen[name].norm(dim=-1), torch.ones(2, 2, 5), name=f"|phi({name})| after qk_norm")
    mixer = make_mixer("linear", 16, 2, qk_norm=True, feature_map="elu+1", backend="chunk", chunk_size=4).double()
    x = 3 * torch.randn(2, 7, 16, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y, _ = step_through(mixer, x)
        assert_close(y, mixer(x), name="linear (elu+1, qk_norm): step vs forward")


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "kda"])
def test_delta_mixers_hand_unit_keys_to_the_delta_rule(gen, monkeypatch, name):
    """Rules out: DeltaNet's default qk_norm=True dropped. The step is then run with the same raw keys as the
    forward (they agree), but the delta rule's step beta in (0, 1) is a contraction only for unit keys."""
    import atlaslib.nn.delta_mixers as mod
    real, seen = mod.delta_rule, {}

    def spy(q, k, *args, **kw):
        seen["q"], seen["k"] = q, k
        return real(q, k, *args, **kw)
    monkeypatch.setattr(mod, "delta_rule", spy)
    seeded(gen)
    mixer = make_mixer(name, 16, 2, backend="chunk")
    with torch.no_grad():
        mixer(3 * torch.randn(2, 6, 16, generator=gen))
    for which in ("q", "k"):
        assert_close(seen[which].norm(dim=-1), torch.ones(2, 2, 6), name=f"{name}: |{which}|")


@pytest.mark.parametrize("name", ["mamba2", "gla", "gated_deltanet", "kda"])
def test_retention_gates_and_steps_follow_their_formulas(gen, monkeypatch, name):
    """Rules out: the gate temperature ignored (a fixed 1/16), KDA's gate made one scalar per head instead of
    one per key channel, and the delta rule's step beta rescaled. Step-vs-forward checks cannot see these
    (both paths call the same gate code), nor can the chunk-vs-recurrent ones. Reference: the documented
    formulas on the layer's own weights, in fp64: log alpha_t = logsigmoid(w^T x_t + b) / tau, one per head
    (mamba2, gated_deltanet) or per head and key channel (gla, kda), and beta_t = sigmoid(w_h^T x_t + b_h)."""
    import atlaslib.nn.delta_mixers as delta_mod
    import atlaslib.nn.linear_mixers as linear_mod
    mod, fn = (delta_mod, "delta_rule") if name in ("gated_deltanet", "kda") else (linear_mod, "linear_attention")
    real, seen = getattr(mod, fn), {}

    def spy(q, k, v, *args, **kw):
        seen["args"], seen["kw"] = args, kw
        return real(q, k, v, *args, **kw)
    monkeypatch.setattr(mod, fn, spy)
    seeded(gen)
    B, T, D, H, K, tau = 2, 5, 16, 2, 3, 4.0
    mixer = make_mixer(name, D, H, head_k_dim=K, gate_temperature=tau, backend="chunk")
    x = torch.randn(B, T, D, generator=gen)
    with torch.no_grad():
        mixer(x)

    def projected(proj):                                   # w^T x_t + b per head (and channel): [B, H, T, w]
        z = x.double() @ proj.weight.double().T + proj.bias.double()
        return z.view(B, T, H, -1).transpose(1, 2)
    per_channel = name in ("gla", "kda")
    want = torch.nn.functional.logsigmoid(projected(mixer.gate_proj)) / tau
    want = want if per_channel else want[..., 0]
    got = seen["kw"]["log_alpha"]
    assert got.shape == ((B, H, T, K) if per_channel else (B, H, T)), f"{name}: log_alpha {list(got.shape)}"
    assert_close(got.double(), want, tol=1e-6, name=f"{name}: log_alpha")
    if fn == "delta_rule":
        assert_close(seen["args"][0].double(), torch.sigmoid(projected(mixer.beta.proj))[..., 0], tol=1e-6,
                     name=f"{name}: beta")


@pytest.mark.parametrize("name", ["linear", "mamba2", "gated_deltanet", "omeganet"])
def test_a_bf16_mixer_steps_with_an_fp32_state(gen, name):
    """Rules out: the step's first memory M_0 is made in the activation dtype instead of fp32. In fp32 and
    fp64 models (all the step tests) that is the same; a bf16 model then accumulates its generation
    state in bf16, while its forward pass accumulates in fp32."""
    seeded(gen)
    kw = {"chunk_size": 1} if name == "omeganet" else {}
    mixer = make_mixer(name, 16, 2, backend="chunk", **kw).to(torch.bfloat16)
    x = torch.randn(2, 24, 16, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        y, cache = step_through(mixer, x)
        ref = mixer(x)
    memory = cache.memory if isinstance(cache.memory, torch.Tensor) else cache.memory.M
    assert memory.dtype == torch.float32, f"{name}: the step's state is {memory.dtype}"
    assert_close(y, ref, tol=TOLERANCE[torch.bfloat16], name=f"{name} (bf16): step vs forward")


# ---------------------------------------------------------------- TinyLM sampling

def test_top_k_sampling_follows_the_tempered_top_k_softmax(gen):
    """Rules out: the top-k threshold taken from the largest logit (top_k > 1 samples the argmax only), and
    the temperature multiplied instead of divided. Both pass the existing checks (top_k=1 is greedy;
    equal seeds give equal draws). Reference: p_i ~ exp(l_i / T) on the k largest logits, 0 elsewhere."""
    vocab, k, T, n = 12, 4, 3.0, 20_000
    logits = 1.5 * torch.randn(1, vocab, generator=gen, dtype=torch.float64)
    draw_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    draws = TinyLM.choose(logits.expand(n, vocab), greedy=False, temperature=T, top_k=k, generator=draw_gen)
    top = logits[0].argsort(descending=True)[:k]
    p = torch.zeros(vocab, dtype=torch.float64)
    p[top] = torch.exp(logits[0, top] / T)
    p = p / p.sum()
    freq = torch.bincount(draws, minlength=vocab).double() / n
    assert set(draws.unique().tolist()) <= set(top.tolist())               # only the k most likely
    assert (freq - p).abs().max() < 0.03, (freq, p)                        # ~8 sigma at n = 20000


def test_top_k_keeps_exactly_the_k_most_likely_for_every_k(gen):
    """Rules out: the mask skipped one k too early (``top_k < vocab - 1``), so top_k = vocab - 1 samples from the
    whole vocabulary. At a high temperature every kept token is about equally likely (1/k each): in 3000 draws
    each of the k most likely tokens appears (a miss has probability below (1 - 1/(2k))^3000 < 1e-100) and no
    other token ever does (its probability is exactly 0)."""
    vocab, n = 6, 3000
    logits = torch.randn(1, vocab, generator=gen, dtype=torch.float64)
    draw_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    for k in range(1, vocab + 1):
        draws = TinyLM.choose(logits.expand(n, vocab), greedy=False, temperature=50.0, top_k=k, generator=draw_gen)
        top = set(logits[0].topk(k).indices.tolist())
        assert set(draws.unique().tolist()) == top, (k, sorted(draws.unique().tolist()), sorted(top))


# ---------------------------------------------------------------- train.py: loss, schedule, data

class Recorder(nn.Module):
    """A TinyLM that keeps the ids and logits of every training-mode forward pass."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.seen = lm, []

    def forward(self, ids):
        out = self.lm(ids)
        if self.training:
            self.seen.append((ids.clone(), out.detach().double()))
        return out


def labelled_cross_entropy(logits, labels):
    """Mean of -log softmax(logits)[label] over the positions whose label is not -100, in fp64."""
    logp = logits.double().log_softmax(-1)
    mask = labels != -100
    return -logp[mask].gather(-1, labels[mask][:, None]).mean()


def test_train_loss_is_the_cross_entropy_of_the_answer_positions(gen):
    """Rules out: the summed cross-entropy divided by every position of the batch instead of the labelled
    ones (the loss, and the gradient, shrink by T / pairs), and the labels shifted once more (logits
    [:, :-1] against labels [:, 1:]: the model is trained to answer one token early). The loss still
    falls in both, which is all the training test checked."""
    seeded(gen)
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=100, num_test=10)
    data = task.data(int(torch.randint(0, 1000, (), generator=gen)))
    train_x, train_y = data[0], data[1]
    model = Recorder(TinyLM(40, 16, 1, "linear", 2))
    res = train_mqar(model, data, steps=4, batch_size=8, lr=1e-2, warmup=2, seed=3, progress=False)
    assert len(model.seen) == 4
    for loss, (ids, logits) in zip(res.losses, model.seen):
        match = (ids[:, None, :] == train_x[None]).all(-1)                 # which training rows were drawn
        assert (match.sum(1) == 1).all()
        y = train_y[match.float().argmax(1)]
        assert loss == pytest.approx(labelled_cross_entropy(logits, y).item(), rel=1e-5)


def test_mqar_loss_ignores_the_unlabelled_positions(gen):
    """Rules out: mqar_loss scores the -100 positions too (here: as class 0)."""
    logits = torch.randn(3, 10, 7, generator=gen)
    labels = torch.randint(0, 7, (3, 10), generator=gen)
    labels[torch.rand(3, 10, generator=gen) < 0.7] = -100
    labels[0, 0] = 2                                                       # at least one labelled position
    assert mqar_loss(logits, labels).item() == pytest.approx(labelled_cross_entropy(logits, labels).item(), rel=1e-5)


def test_learning_rate_warms_up_then_decays_to_zero(monkeypatch):
    """Rules out: warm-up factor s / warmup (the first step has learning rate 0 and does nothing) and a full
    cosine period (the rate climbs back to its peak at the end). Checked on the rate AdamW sees at
    every step: positive, rising during warm-up to about lr, then never rising again, and ending near 0."""
    rates = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            rates.append(self.param_groups[0]["lr"])
            return super().step(closure)
    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=50, num_test=4)
    torch.manual_seed(0)
    lr, warmup, steps = 1e-2, 5, 40
    train_mqar(TinyLM(40, 8, 1, "linear", 2), task.data(0), steps=steps, batch_size=4, lr=lr, warmup=warmup,
               progress=False)
    assert len(rates) == steps
    assert all(r > 0 for r in rates), rates[:3]
    peak = max(range(steps), key=rates.__getitem__)
    assert peak < warmup and rates[peak] > 0.9 * lr
    assert all(a < b for a, b in zip(rates[:peak], rates[1:peak + 1]))        # rising during warm-up
    assert all(b <= a for a, b in zip(rates[peak:], rates[peak + 1:]))        # then never rising again
    assert rates[-1] < 0.01 * lr


def test_every_step_sees_clipped_gradients_and_the_weight_decay_asked_for(gen, monkeypatch):
    """Rules out: the gradient clipping dropped (a loss spike then moves every weight by its full size), and
    the weight_decay argument not handed to AdamW (its own default, 0.01, instead of the 0.1 documented).
    Both still train and still reproduce a seeded run, which is all the other tests check. The head is
    scaled up so that every unclipped gradient has a norm far above 1 (15-30 here): each step AdamW takes
    must see the whole gradient at norm 1."""
    seen = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            seen.append((torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item(),
                         self.param_groups[0]["weight_decay"]))
            return super().step(closure)
    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=50, num_test=4)
    for weight_decay in (None, 0.05):
        seen.clear()
        seeded(gen)
        lm = TinyLM(40, 8, 1, "linear", 2)
        with torch.no_grad():
            lm.head.weight.mul_(20.0)
        kw = {} if weight_decay is None else {"weight_decay": weight_decay}
        train_mqar(lm, task.data(0), steps=6, batch_size=4, progress=False, **kw)
        assert len(seen) == 6
        for norm, decay in seen:
            assert norm == pytest.approx(1.0, rel=1e-4), f"gradient norm {norm} at a step"
            assert decay == (0.1 if weight_decay is None else weight_decay)


def test_held_out_data_is_not_the_training_data(gen):
    """Rules out: MQARTask.data draws the test split with the training seed, so the held-out accuracy is
    measured on training sequences (with equal sizes, the very same ones)."""
    task = MQARTask(vocab_size=64, seq_len=32, num_kv_pairs=4, num_train=50, num_test=50)
    train_x, _, test_x, _ = task.data(int(torch.randint(0, 1000, (), generator=gen)))
    assert not (test_x[:, None, :] == train_x[None]).all(-1).any()


def test_mqar_task_data_is_mqar_with_its_fields(gen):
    """Rules out: a field of MQARTask (power_a, random_filler) left out of the call to ``mqar``, which then uses
    its own default (power_a 0.01, random filler). Reference: ``mqar`` called here with every field, the
    training split with seed 2 s and the held-out split with seed 2 s + 1, as ``MQARTask.data`` documents."""
    s = int(torch.randint(0, 1000, (), generator=gen))
    task = MQARTask(vocab_size=96, seq_len=32, num_kv_pairs=4, num_train=30, num_test=20, power_a=1.0,
                    random_filler=False)
    kw = dict(seq_len=32, num_kv_pairs=4, vocab_size=96, power_a=1.0, random_non_queries=False)
    want = (*mqar(30, seed=2 * s, **kw), *mqar(20, seed=2 * s + 1, **kw))
    got = task.data(s)
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_each_step_is_one_adamw_step_on_the_clipped_gradient_of_its_own_batch(gen, monkeypatch):
    """Rules out: the gradients not zeroed between steps (a loop that forgot zero_grad piles each step's gradient
    onto the last ones), and AdamW's betas changed from (0.9, 0.98), those the committed runs in results/ were
    trained with (with 0.999 the replayed cell of test_experiments no longer reproduces, a 2-minute test).
    Neither shows in a loss that falls. Reference, in fp64: the gradient of
    each step's batch loss (the batch as the model saw it), computed here from a copy of the weights, clipped
    to norm 1, and a hand-written AdamW update (decoupled weight decay 0.1, eps 1e-8) at the learning rate the
    optimiser had at that step (its schedule is checked by the warm-up test). One step alone cannot tell the
    betas apart (Adam's first step is lr * g / |g| elementwise, whatever they are): three are taken."""
    import copy
    snapshots = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            params = self.param_groups[0]["params"]
            snapshots.append(([p.detach().clone() for p in params], [p.grad.clone() for p in params],
                              self.param_groups[0]["lr"]))
            return super().step(closure)
    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    seeded(gen)
    task = MQARTask(vocab_size=40, seq_len=16, num_kv_pairs=2, num_train=100, num_test=4)
    train_x, train_y, *_ = data = task.data(int(torch.randint(0, 1000, (), generator=gen)))
    lm = TinyLM(40, 16, 1, "linear", 2).double()
    ref = copy.deepcopy(lm)
    model = Recorder(lm)
    seed = int(torch.randint(0, 1000, (), generator=gen))
    train_mqar(model, data, steps=3, batch_size=8, lr=3e-2, warmup=1, seed=seed, progress=False)
    assert len(snapshots) == len(model.seen) == 3
    params = list(ref.parameters())
    m1, m2 = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    beta1, beta2, eps, decay = 0.9, 0.98, 1e-8, 0.1
    for t, ((weights, grads, lr), (ids, _)) in enumerate(zip(snapshots, model.seen), start=1):
        for p, w in zip(params, weights):                                  # the hand-written updates so far
            torch.testing.assert_close(w, p.detach(), rtol=1e-10, atol=1e-12, msg=f"weights before step {t}")
        y = train_y[(ids[:, None, :] == train_x[None]).all(-1).float().argmax(1)]
        g = torch.autograd.grad(labelled_cross_entropy(ref(ids), y), params)
        norm = torch.linalg.vector_norm(torch.stack([x.norm() for x in g]))
        g = [x * min(1.0, 1.0 / (norm.item() + 1e-6)) for x in g]           # clip_grad_norm_ at 1
        for a, b in zip(grads, g):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"gradient at step {t}")
        with torch.no_grad():
            for p, x, m, v in zip(params, g, m1, m2):
                p.mul_(1 - lr * decay)
                m.mul_(beta1).add_((1 - beta1) * x)
                v.mul_(beta2).add_((1 - beta2) * x * x)
                p.sub_(lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps))
    for p, q in zip(lm.parameters(), params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-10, atol=1e-12, msg="weights after the last step")


# ---------------------------------------------------------------- tasks/capacity.py

def test_gd_memory_default_step_is_one_over_the_largest_squared_singular_value(gen):
    """Rules out: the default step 1 / sigma_max(K)^2 computed with the Frobenius norm (a smaller, still stable
    step: gd_memory still converges in the 3000 steps the old test gives it, just more slowly).
    One step from M = 0 is lr * V^T K."""
    K, V = random_pairs(6, 10, 4, generator=gen)
    sigma = torch.linalg.svdvals(K)[0]
    assert_close(gd_memory(K, V, steps=1), V.T @ K / sigma**2, name="first GD step")
    # the residual R = M K^T - V^T shrinks along each left singular vector u_i of K by |1 - lr sigma_i^2| <= 1
    # a step: the stiffest direction is solved in one step (factor 0), and no direction grows
    U = torch.linalg.svd(K, full_matrices=False).U
    along = lambda M: ((M @ K.T - V.T) @ U).norm(dim=0)                     # noqa: E731
    r0, r1, r200 = along(torch.zeros(V.shape[1], K.shape[1], dtype=K.dtype)), along(gd_memory(K, V, steps=1)), \
        along(gd_memory(K, V, steps=200))
    assert r1[0] < 1e-9 * r0[0] and (r200 <= r0 * (1 + 1e-9)).all()
