"""Train a matrix-factorisation recommender on generated interactions with Tidal.

The data is generated, with structure planted in it: every user and every item has a hidden
vector of ``--true-rank`` factors and every item a popularity. A user is shown random items
and clicks one with probability ``sigmoid(user . item + popularity)``. The model sees only
(user, item, clicked) triples and learns its own embeddings and biases; its held-out
``auc`` is measured on (user, item) pairs it never saw, next to ``oracle_auc``, the AUC of
the true click probabilities on the same pairs (the best any model can do on that sample).

The lines marked ``# tidal`` are the ones that differ from a plain PyTorch loop. Run alone
(``python examples/recsys.py``) it trains on one process with the same mathematics.
"""

from __future__ import annotations

import argparse

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tidal

torch.set_num_threads(1)  # several workers may share a few cores

DATA_SEED = 1234  # the generated world, fixed whatever --seed is


def generate(
    *, users: int, items: int, true_rank: int, interactions: int, held_out: float
) -> tuple[TensorDataset, tuple[torch.Tensor, ...]]:
    """(train set of (user, item, clicked), held-out (user, item, clicked, true logit)).

    The pairs are distinct, so no held-out pair is in the training set.
    """
    gen = torch.Generator().manual_seed(DATA_SEED)
    user_f = torch.randn(users, true_rank, generator=gen)
    item_f = torch.randn(items, true_rank, generator=gen)
    popularity = torch.randn(items, generator=gen) - 1.0
    scale = 2.0 / true_rank**0.5  # the dot product has standard deviation 2
    pairs = torch.randperm(users * items, generator=gen)[:interactions]
    user, item = pairs // items, pairs % items
    logit = scale * (user_f[user] * item_f[item]).sum(1) + popularity[item]
    clicked = (torch.rand(interactions, generator=gen) < torch.sigmoid(logit)).float()
    n_test = int(interactions * held_out)
    train = TensorDataset(user[n_test:], item[n_test:], clicked[n_test:])
    return train, (user[:n_test], item[:n_test], clicked[:n_test], logit[:n_test])


class MatrixFactorization(nn.Module):
    """score(user, item) = <user embedding, item embedding> + user bias + item bias + bias."""

    def __init__(self, users: int, items: int, dim: int) -> None:
        super().__init__()
        self.user = nn.Embedding(users, dim)
        self.item = nn.Embedding(items, dim)
        self.user_bias = nn.Embedding(users, 1)
        self.item_bias = nn.Embedding(items, 1)
        self.bias = nn.Parameter(torch.zeros(1))
        for emb in (self.user, self.item):
            nn.init.normal_(emb.weight, std=0.1)
        for emb in (self.user_bias, self.item_bias):
            nn.init.zeros_(emb.weight)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        dot = (self.user(user) * self.item(item)).sum(-1)
        return dot + self.user_bias(user)[:, 0] + self.item_bias(item)[:, 0] + self.bias


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the chance a random positive outscores a random negative."""
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return ((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)).item()


@torch.no_grad()
def evaluate(model: nn.Module, test: tuple[torch.Tensor, ...]) -> tuple[float, float]:
    """Held-out (auc, loss)."""
    user, item, clicked, _ = test
    scores = model(user, item)
    return auc(scores, clicked), F.binary_cross_entropy_with_logits(scores, clicked).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--global-batch-size", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--dim", type=int, default=16, help="embedding size of the model")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--true-rank", type=int, default=8, help="planted latent factors")
    parser.add_argument("--interactions", type=int, default=300_000)
    parser.add_argument("--held-out", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="PATH", help="write the final parameters here")
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()

    train_set, test = generate(
        users=args.users,
        items=args.items,
        true_rank=args.true_rank,
        interactions=args.interactions,
        held_out=args.held_out,
    )
    oracle = auc(test[3], test[2])
    torch.manual_seed(args.seed)
    model = MatrixFactorization(args.users, args.items, args.dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    trainer = tidal.Trainer(  # tidal
        model,
        optimizer,
        train_set,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
    )
    for step in trainer.run(max_steps=args.max_steps):  # tidal
        for user, item, clicked in step.micro_batches():  # tidal
            scores = trainer.model(user, item)  # tidal: trainer.model
            loss = F.binary_cross_entropy_with_logits(scores, clicked)
            step.backward(loss)  # tidal
        if step.index % args.log_every == 0 and trainer.rank == 0:
            test_auc, _ = evaluate(model, test)
            tidal.log(loss=loss.item(), auc=test_auc, oracle_auc=oracle)  # tidal
            print(
                f"step {step.index}: loss {loss.item():.4f}, held-out auc {test_auc:.4f} "
                f"(oracle {oracle:.4f})",
                flush=True,
            )

    if trainer.completed and trainer.rank == 0:
        test_auc, test_loss = evaluate(model, test)
        tidal.log(auc=test_auc, test_loss=test_loss, oracle_auc=oracle)  # tidal
        print(
            f"done after {trainer.step} steps: held-out auc {test_auc:.4f} (oracle {oracle:.4f}), "
            f"loss {test_loss:.4f}",
            flush=True,
        )
        if args.save:
            state = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
            safetensors.torch.save_file(state, args.save)


if __name__ == "__main__":
    main()
