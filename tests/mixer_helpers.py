"""Helpers shared by the mixer tests: the global seed from the test's generator, and a layer run token by token."""
import torch


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
