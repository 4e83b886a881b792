"""The LSTM recipe's text classifier: embedding -> LSTM -> linear over the last hidden state.

Inputs are (B, T) token ids right-padded with 0 (<PAD>). The LSTM runs on packed sequences,
so padding changes nothing. A stage passes one tensor, so the embedding stage appends the
mask of real tokens as a last feature and the LSTM stage reads each sequence's length off it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from parallab.models.base import Model, fits_classes, in_range


class MaskedEmbedding(nn.Module):
    """(B, T) ids -> (B, T, E + 1): embeddings, then 1.0 where a token is real (not <PAD>)."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(tokens)
        return torch.cat([embedded, (tokens != 0).unsqueeze(-1).to(embedded.dtype)], dim=-1)


class PackedLSTM(nn.Module):
    """(B, T, E + 1) -> (B, H): the last layer's hidden state after each sequence's last real
    token (right padding assumed: the length is the count of real tokens)."""

    def __init__(self, input_dim: int, hidden_dim: int, num_layers: int, dropout: float):
        super().__init__()
        self.lstm = nn.LSTM(input_dim, hidden_dim, num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features, mask = x[..., :-1], x[..., -1]
        # pack wants the lengths on the CPU (a device sync); an all-padding row counts as one.
        # Counting mask > 0.5 keeps them in 1..T even for the uninitialised tensors that
        # pipelining's shape inference passes in.
        lengths = (mask > 0.5).sum(dim=1).clamp(min=1).cpu()
        packed = pack_padded_sequence(features, lengths, batch_first=True, enforce_sorted=False)
        _, (hidden, _) = self.lstm(packed)  # hidden: (layers, B, H), in the input's order
        return hidden[-1]


class LSTMClassifier(Model):
    def __init__(self, vocab_size: int, num_classes: int, embedding_dim: int = 64,
                 hidden_dim: int = 128, num_layers: int = 1, dropout: float = 0.0):
        super().__init__()
        self.embed = MaskedEmbedding(vocab_size, embedding_dim)
        self.encoder = PackedLSTM(embedding_dim, hidden_dim, num_layers, dropout)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(hidden_dim, num_classes))

    def stages(self) -> list[nn.Module]:
        return [self.embed, self.encoder, self.head]

    @classmethod
    def check_data(cls, cfg, data) -> str | None:
        problem = in_range(cfg, {"embedding_dim": 1, "hidden_dim": 1, "num_layers": 1,
                                 "num_classes": 1}, below_one=("dropout",))
        if problem:
            return problem
        vocab = getattr(data, "vocab_size", None)
        if vocab is None or data.next_token:  # bytes: a target per token, not per text
            return (f"model=lstm classifies token sequences, which data={data.name} does not "
                    "give: use data=text, or data=synthetic with data.vocab_size=N")
        if cfg["vocab_size"] is None:
            cfg["vocab_size"] = vocab
        if cfg["vocab_size"] != vocab:
            return (f"model.vocab_size={cfg['vocab_size']} does not match the {vocab} tokens of "
                    f"data={data.name}'s vocabulary: set model.vocab_size={vocab} (or null), or "
                    "use the data settings the model was trained with")
        return fits_classes(cfg, data)
