"""Helpers shared by the mixer tests: the global seed from the test's generator, and a layer run token by token."""
import torch
import torch.nn.functional as F


def seeded(gen):
    """Seed torch's global RNG (a mixer's weights) from the test's generator."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))


def step_through(mixer, x):
    """The mixer's one-token step over x [B, T, d_model]: (outputs [B, T, d_model], the last cache)."""
    cache, ys = None, []
    for t in range(x.shape[1]):
        y_t, cache = mixer.step(x[:, t], cache)
        ys.append(y_t)
    return torch.stack(ys, dim=1), cache


def projections(m, x):
    """A windowed mixer's (chapters 4-5) q, k (unit, then through phi), v [B, H, T, .] and gates, computed
    here from its weights: gamma = sigmoid(.) [B, H, T, c or 1], alpha = sigmoid(.)^(1/temperature),
    eta = eta_max sigmoid(.) (the layer has no convolution: conv_size=0)."""
    def heads(t):
        B, T, _ = t.shape
        return t.view(B, T, m.n_heads, -1).transpose(1, 2)
    q, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if m.poly is not None:
        q, k = F.normalize(m.poly(q), dim=-1), F.normalize(m.poly(k), dim=-1)
    gam = heads(torch.sigmoid(m.gamma_proj(x)))                                        # [B, H, T, c or 1]
    alpha = torch.sigmoid(m.gate_proj(x)).pow(1 / m.gate_temperature).transpose(1, 2)   # [B, H, T]
    eta = m.eta_max * torch.sigmoid(m.eta_proj(x)).transpose(1, 2)
    return q, k, v, gam, alpha, eta
