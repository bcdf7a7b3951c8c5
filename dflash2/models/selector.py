"""DFlash 2 low-rank candidate selector (contract section 2.3).

For each block slot e the selector reranks the top-k candidates of the (transformed) unary logits
using the token chosen at slot e-1:

    score_e(p, c) = u_e[c] + sum_r A[p, r] * g_e[r] * Bc[c, r],   g_e = hidden_projection(h_e)

with A the predecessor codebook and Bc the successor codebook (zero at init, so a fresh selector
ranks exactly like the unary logits).
"""

from __future__ import annotations

import torch
from torch import nn


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        # Plain parameters (not nn.Embedding): the exported names carry no `.weight` suffix.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        candidates: torch.Tensor,
        predecessors: torch.Tensor,
    ) -> torch.Tensor:
        """Scores of every (predecessor, candidate) pair.

        hidden [..., H] final draft state of the slot; unary, candidates [..., k]; predecessors [..., P]
        token ids -> [..., P, k]. A module forward (not a helper) so that sharding wrappers gather the
        codebooks when the objective calls it.
        """
        hidden_rank = self.hidden_projection(hidden)  # [..., r]
        pred = self.predecessor_codebook[predecessors] * hidden_rank.unsqueeze(-2)  # [..., P, r]
        succ = self.successor_codebook[candidates]  # [..., k, r]
        return unary.unsqueeze(-2) + pred @ succ.transpose(-1, -2).to(pred.dtype)

    def lattice(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Build the [b, E, k, k] lattice for E = B-1 slots.

        hidden [b, E, H] final draft states of slots 1..B-1; logits [b, E, V] transformed unary logits;
        anchor_ids [b]. Row p of slot e holds the scores after predecessor p: for slot 1 every row is
        the anchor (rows identical); for e > 1, row p is candidate p of slot e-1.
        Returns (lattice, candidates [b, E, k]); candidates sorted by unary score, descending.
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        first = anchor_ids[:, None, None].expand(-1, 1, self.top_k)
        predecessors = torch.cat([first, candidates[:, :-1]], dim=1)  # [b, E, k]
        return self(hidden, unary, candidates, predecessors), candidates

    @staticmethod
    def walk(
        lattice: torch.Tensor,
        candidates: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One left-to-right pass from the anchor (not Viterbi, not a tree).

        Greedy takes the first max of the row of the previously chosen token; at temperature > 0 it
        samples from softmax(row / T) and returns those rows q [b, E, k] for lossless rejection sampling.
        Returns (tokens [b, E], indices [b, E], q or None).
        """
        batch, num_slots, top_k, _ = lattice.shape
        row = torch.zeros(batch, dtype=torch.long, device=lattice.device)  # slot 1: all rows are the anchor
        arange = torch.arange(batch, device=lattice.device)
        indices, q_rows = [], []
        for slot in range(num_slots):
            scores = lattice[arange, slot, row]  # [b, k]
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                row = torch.multinomial(q, 1, generator=generator)[:, 0]
                q_rows.append(q)
            else:
                row = torch.argmax(scores, dim=-1)
            indices.append(row)
        index = torch.stack(indices, dim=1)
        tokens = candidates.gather(-1, index[..., None])[..., 0]
        return tokens, index, (torch.stack(q_rows, dim=1) if q_rows else None)
