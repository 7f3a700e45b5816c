"""float64 autograd through a block's state, shared by the Mamba-2 and
Mamba-3 state-gradient oracles: the gradient of sum(y g) + <cot, final
state> for x, every weight and every array of the start state."""
import numpy as np
import torch


def _f64(a, grad=False):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def state_vjp(forward, weights, x, g, names, states, cotangents):
    """{name: ndarray}: 'x', each weight, and 'state.<name>' for each state
    array (zeros where the forward does not read it).

    forward(W, x, st) -> (y, final): a float64 torch forward from the state
    st (a dict by name) that returns the final state by name. Rows of a
    ``buffer_*`` cotangent past the final state's rows carry nothing (the
    final state holds only its buffered_tokens rows); an empty final array
    contributes nothing.
    """
    with torch.enable_grad():
        W = {k: _f64(v, True) for k, v in weights.items()}
        xt = _f64(x, True)
        st = {n: _f64(a, True) for n, a in zip(names, states)}
        y, final = forward(W, xt, st)
        loss = (y * _f64(g)).sum()
        for n, cv in zip(names, cotangents):
            f = final[n]
            if f.numel() == 0:
                continue
            ct = _f64(cv)
            if n.startswith("buffer_"):
                ct = ct[:, :f.shape[1]]
            loss = loss + (f * ct).sum()
        loss.backward()
    out = {"x": xt.grad.numpy().copy()}
    for k, v in W.items():
        out[k] = v.grad.numpy().copy()
    for n, v in st.items():
        out[f"state.{n}"] = v.grad.numpy().copy() if v.grad is not None else np.zeros(v.shape)
    return out
