"""Policy gradient (REINFORCE with a learned baseline) on gymnasium's CartPole-v1 with Tidal.

The global batch is a number of *episodes* per update. The data set is ``tidal.IndexDataset``:
its samples are episode indices, and each worker plays its share of the step's episodes. An
episode is a function of its index alone: the environment is reset with
``tidal.sample_seed(seed, epoch, index)`` and the policy samples its actions from a
generator seeded the same way, so the episode (and its gradient) is the same whichever
worker plays it. Each micro-batch's loss is the mean over its episodes; Tidal weights it by
its share of the global batch, so the update is the mean over all the step's episodes
whatever the world size: a run that scales 2 -> 3 -> 2 workers ends with the parameters of a
one-worker run. The policy computes in float64 so that no action sample sits on a rounding
difference between world sizes (float32 would flip one now and then, and the episode with
it).

The lines marked ``# tidal`` are the ones that differ from a plain PyTorch loop. Run alone
(``python examples/cartpole.py``) it trains on one process with the same mathematics.
"""

from __future__ import annotations

import argparse

import gymnasium as gym
import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import tidal

torch.set_num_threads(1)  # several workers may share a few cores

EPISODES = 4096  # episode indices per epoch: any number >= the global batch size
EVAL_EPOCH = -1  # held-out episodes: seeds no training epoch (>= 0) uses


class ActorCritic(nn.Module):
    """A policy (logits of push left / push right) and a value baseline, each an MLP."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.pi = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))
        self.v = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pi(obs), self.v(obs).squeeze(-1)


@torch.inference_mode()
def play(env: gym.Env, policy: nn.Module, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One episode: states, actions and rewards. A function of ``seed`` and the policy only."""
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng((seed, 1))  # the policy's own stream, apart from the env's
    states, actions, rewards = [], [], []
    done = False
    while not done:
        p_right = torch.softmax(policy(torch.from_numpy(obs).double()), -1)[1].item()
        action = int(rng.random() < p_right)
        states.append(obs)
        actions.append(action)
        obs, reward, terminated, truncated, _ = env.step(action)
        rewards.append(reward)
        done = terminated or truncated
    return np.array(states), np.array(actions), np.array(rewards)


def returns_to_go(rewards: np.ndarray, gamma: float) -> np.ndarray:
    out = np.zeros(len(rewards))
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def evaluate(env: gym.Env, policy: nn.Module, episodes: int) -> float:
    """Mean return of the (sampling) policy over fixed held-out episodes."""
    seeds = [tidal.sample_seed(0, EVAL_EPOCH, k) for k in range(episodes)]
    return float(np.mean([play(env, policy, s)[2].sum() for s in seeds]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=100, help="policy updates")
    parser.add_argument("--global-batch-size", type=int, default=16, help="episodes an update")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--return-scale", type=float, default=10.0, help="returns divided by")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", metavar="PATH", help="write the final parameters here")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-episodes", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = ActorCritic().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    env = gym.make("CartPole-v1")

    trainer = tidal.Trainer(  # tidal
        model,
        optimizer,
        tidal.IndexDataset(EPISODES),  # tidal: samples are episode indices
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
    )
    mean_return = float("nan")
    for step in trainer.run(max_steps=args.max_steps):  # tidal
        played = []
        for episodes in step.micro_batches():  # tidal: this worker's episode indices
            states, actions, targets, owner = [], [], [], []
            for k, seed in enumerate(tidal.sample_seeds(step, episodes)):  # tidal
                s, a, r = play(env, model.pi, seed)
                states.append(s)
                actions.append(a)
                targets.append(returns_to_go(r, args.gamma) / args.return_scale)
                owner.append(np.full(len(r), k))
                played.append(r.sum())
            obs = torch.from_numpy(np.concatenate(states)).double()
            act = torch.from_numpy(np.concatenate(actions))
            target = torch.from_numpy(np.concatenate(targets))
            logits, value = trainer.model(obs)  # tidal: trainer.model
            logp = F.log_softmax(logits, -1).gather(1, act[:, None]).squeeze(1)
            advantage = target - value.detach()
            per_step = -logp * advantage + 0.5 * (value - target) ** 2
            loss = per_step.sum() / len(episodes)  # mean over episodes of each one's sum
            step.backward(loss)  # tidal
        if step.index % args.log_every == 0 and trainer.rank == 0:
            mean_return = evaluate(env, model.pi, args.eval_episodes)
            tidal.log(mean_return=mean_return, train_return=float(np.mean(played)))  # tidal
            print(
                f"update {step.index}: held-out mean return {mean_return:.1f}, "
                f"this worker's episodes {np.mean(played):.1f}",
                flush=True,
            )

    if trainer.completed and trainer.rank == 0:
        mean_return = evaluate(env, model.pi, args.eval_episodes)
        tidal.log(mean_return=mean_return)  # tidal
        print(f"done after {trainer.step} updates: held-out mean return {mean_return:.1f}")
        if args.save:
            state = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
            safetensors.torch.save_file(state, args.save)


if __name__ == "__main__":
    main()
