"""The LM head and its cross-entropy in one pass over chunks of tokens, with no B x T x vocab float32 logits ever
held: each chunk's logits are computed, turned into the chunk's loss and its gradients (of the hidden states and of
the head's weight), and dropped, so that the backward pass only scales what the forward pass left. The head's rows are
padded with zeros to a multiple of `rows_multiple` for the matrix multiply (tensor cores want multiples of 64 or 128;
GPT-2's vocabulary of 50257 is not), and the logits sliced back before the softmax: the loss, the gradients, the
parameter count and the checkpoints are those of the plain head. In float32 the result equals
F.cross_entropy(F.linear(h, W).float(), y) up to the order of summation (tests/test_head_loss.py)."""

import torch
import torch.nn.functional as F


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `h` runs in: autocast's where it is on, else h's own (as F.linear would)."""
    device = h.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype


def padded(weight: torch.Tensor, rows_multiple: int, dtype: torch.dtype) -> torch.Tensor:
    rows = weight.shape[0]
    return F.pad(weight.to(dtype), (0, 0, 0, -rows % rows_multiple))


class ChunkedHeadLoss(torch.autograd.Function):
    """Mean cross-entropy of logits h @ W.T against targets; h of shape (N, d), W (vocab, d), targets (N,)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int, rows_multiple: int):
        vocab, dtype, needs_grad = weight.shape[0], compute_dtype(h), ctx.needs_input_grad[:2]
        with torch.autocast(h.device.type, enabled=False):
            w = padded(weight, rows_multiple, dtype)
            loss = torch.zeros((), device=h.device, dtype=torch.float32)
            grad_h = torch.empty_like(h) if needs_grad[0] else None
            grad_w = torch.zeros(w.shape, device=w.device, dtype=torch.float32) if needs_grad[1] else None
            for start in range(0, h.shape[0], chunk):  # each chunk's tensors freed before the next is made
                h_c, t_c = h[start:start + chunk].to(dtype), targets[start:start + chunk]
                logits = (h_c @ w.T)[:, :vocab].float()
                lse = torch.logsumexp(logits, dim=1)
                loss += (lse - logits.gather(1, t_c[:, None]).squeeze(1)).sum()
                if not any(needs_grad):
                    continue
                logits.sub_(lse[:, None]).exp_()  # in place: softmax - one-hot, d(sum of losses)/d(logits)
                logits[torch.arange(len(t_c), device=t_c.device), t_c] -= 1
                grad_logits = F.pad(logits.to(dtype), (0, w.shape[0] - vocab))
                del logits
                if grad_h is not None:
                    grad_h[start:start + chunk] = grad_logits @ w
                if grad_w is not None:
                    grad_w += grad_logits.T @ h_c
                del grad_logits
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w[:vocab])
        ctx.n = h.shape[0]
        return loss / ctx.n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss / ctx.n
        return (None if grad_h is None else grad_h * scale.to(grad_h.dtype),
                None if grad_w is None else grad_w * scale.to(grad_w.dtype), None, None, None)


def head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 8192,
              rows_multiple: int = 1) -> torch.Tensor:
    """The mean next-token loss of hidden states `h` (..., d) through the head `weight` against `targets` (...), in
    chunks of `chunk` tokens, the head padded to a multiple of `rows_multiple` rows (1: not padded)."""
    return ChunkedHeadLoss.apply(h.flatten(0, -2), weight, targets.flatten(), chunk, rows_multiple)
