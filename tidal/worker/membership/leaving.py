"""Whether a member leaving at a change commits its last step: the rule, pure.

At a planned change that drops a member (a scale-down, a ``--schedule`` step), the leaver's
last update is wasted: it leaves the group right after, to wait as a standby or to exit,
and whatever state it keeps is older than the job's by the time it is a member again (it
is healed then, like any joiner). On a machine whose cores the members fill, that update
also delays the members that stay: three members' updates on two cores end up to a
scheduler slice apart, and the survivors' rendezvous waits for the last of them (the
scale-down's largest phase, docs/benchmarks.md). So a member that knows, before its
update, that the generation after this step does not include it, leaves with the step
uncommitted, exactly as after a failed step (its tracked state rewound, its gradients
dropped): it holds the job's state of the step before, consistent, and is healed forward
if it is ever needed again.

Contract: it never leaves uncommitted when its update is needed by anyone:

- sharded training (every member's update is its own shard's, gathered for the leavers);
- the script's ``after_step`` hooks: they run after each step a member commits and may do
  what no tracked state undoes (record the samples this member trained on, write files), so
  a member with hooks commits its last step as every member did before this rule;
- a checkpoint due at this step on this member (the generation's rank 0 writes it);
- the job's last step, or a stop (the members' final state and checkpoint);
- a change that is not agreed at this step: only the control word's switch or a
  ``--schedule`` hold step makes every member leave the generation after it.

A newer generation that drops this member, seen in an answer older than the coordinator's
latest decision, costs nothing wrong: if a later generation takes it back, the heal finds
it a step behind and sends it the state.
"""

from __future__ import annotations


def leave_uncommitted(
    *,
    excluded: bool,
    at_change: bool,
    sharded: bool,
    hooks: bool,
    checkpoint_due: bool,
    stop: bool,
    last: bool,
) -> str | None:
    """Why this member leaves with its step uncommitted, or None to commit it (module doc).
    ``excluded``: the newest answer names a newer generation without this member;
    ``at_change``: every member leaves the generation after this step (a switch, or a hold
    step); ``hooks``: the script registered ``after_step`` hooks; ``checkpoint_due``: this
    member writes a checkpoint of this step."""
    if not (excluded and at_change):
        return None
    if sharded or hooks or checkpoint_due or stop or last:
        return None
    return "the next generation does not include this member: its last update is skipped"
