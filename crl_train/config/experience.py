"""The ``experience`` section: the experience layer as the trainer drives it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from crl_gym.experience.schemas import MAX_ACTION_SLOT, MAX_OPS
from crl_train.config.io import ConfigError, check_choices


@dataclass(frozen=True)
class ExperienceConfig:
    """The experience layer as the trainer drives it."""

    embedder: str = "hashing"
    """``hashing`` (fast bag-of-n-grams), ``minilm`` (the bundled all-MiniLM-L6-v2) or a model path.
    """
    embed_dim: int = 256
    """Dimension of the ``hashing`` embedder (others report their own)."""
    seed_entries: tuple[str, ...] | dict[str, tuple[str, ...]] = ()
    """Entries put in an empty bank at start (they have no provenance, so they are never trained).
    A list: for every env of the run. A mapping ``{env id: [texts]}``: each text tagged with its env
    id and put in the bank only when that id is in ``env.ids`` (a preset's entries for one env never
    reach another's bank)."""
    search_and_ask: bool = False
    """Give the actor the search_and_ask tool (paper: on)."""
    max_search_calls: int = 2
    """search_and_ask calls per episode."""
    asynchronous: bool = True
    """Run the background track in its own thread; False = each actor step waits for it (benchmark).
    """
    extractor_process: bool | None = None
    """Run the extractor's model work in a child process (``crl_train.extractor.worker``) so the two
    tracks do not share the GIL. None = auto: on when ``asynchronous`` and the method uses
    experience (a synchronous run waits for the extractor anyway); False keeps it in process
    (debugging)."""
    extractor_start_method: Literal["spawn", "forkserver"] = "spawn"
    """How the extractor process is started (``fork`` is unsafe once torch has started threads)."""
    extractor_nice: int = 0
    """Niceness added to the extractor process (0–19): with oversubscribed cores the actor runs
    first."""
    distill_batch: int = 8
    """Distillation requests the background track takes from the queue per generate call."""
    distill_linger_s: float = 2.0
    """Asynchronous track: after the first request, wait up to this long for a full
    ``distill_batch`` (episodes end one by one; a full batch costs about what a single request
    does)."""
    distill_fraction: float = 1.0
    """Share of finished episodes the extractor distils (1: every one, the paper). Below 1 each one
    is drawn by a hash of its content and the run's seed (the same draw on a resume; identical
    episodes are drawn together); an undrawn episode still credits the entry that guided it. For
    CPU-sized runs whose extractor cannot keep up with every episode."""
    distill_per_group: int = 0
    """Episodes of each rollout group the extractor distils (0: off; then ``distill_fraction``
    decides), chosen outcome-blind and spread over the group (2: one guided and one free, the paper
    distils both halves): every task played gets entries at a fixed cost per group. Not the paper's
    rule (it distils every episode); for CPU-sized runs. Every undistilled episode still credits its
    entry."""
    actor_threads: int = 1
    """torch intra-op threads of the trainer process (the primary loop's share of the cores)."""
    extractor_threads: int = 1
    """torch intra-op threads of the extractor process (its share of the cores; in process, torch's
    pool is process-wide and ``actor_threads`` applies to both tracks)."""
    pin_cpus: bool = True
    """Pin each track to its own cores (``os.sched_setaffinity``; see
    ``crl_train.policy.affinity``): the trainer process to ``actor_cpus``, the extractor process to
    ``extractor_cpus``. False = no pinning."""
    actor_cpus: tuple[int, ...] | None = None
    """Cores of the trainer process (primary loop; grpo and an in-process extractor get these too).
    None = the first half of the available cores (the larger half; nothing pinned on 1 core)."""
    extractor_cpus: tuple[int, ...] | None = None
    """Cores of the extractor process. None = the available cores not given to the actor."""
    offline_source: str | None = None
    """offline_exp: a ``trajectories.jsonl`` of a prior run (distilled once) or a bank ``.jsonl``
    export."""
    max_prompt_chars: int = 6000
    """Longest distillation prompt in characters (the trajectory is shortened to fit)."""
    max_entry_chars: int | None = None
    """Longest entry text (and refined advice) the extractor's answer schemas allow; it also bounds
    a structured answer's token budget. None: 64 for the tiny extractor, 2000 otherwise."""
    max_ops: int = MAX_OPS
    """Most operations in one distillation answer (the length of its JSON list; the paper sets no
    bound). Each entry of an answer is credited on its own and carries the whole answer as its
    sample, so an answer of k adds enters B_φ k times; 1 makes every answer one entry and one
    sample."""
    action_slot: int = 0
    """The action slot (docs/experience.md, "The action slot"): N > 0 makes each distillation
    answer's add / update first choose 1 to N of its episode's admissible actions (an enum of the
    grammar, the union of ``info["admissible_actions"]`` over its steps), and its entry reads ``Play
    a, then b. <text>``. For a small extractor that names no action on its own. 0 = off (at most 8).
    Distillation only (not refinement, merge or EDGE's reflection); an experience setting: keep it
    the same for every method of a comparison."""
    retrieve: Literal["episode", "turn", "both"] = "episode"
    """When a guided episode retrieves: ``episode`` (once, for the task, at its start: the paper),
    ``turn`` (before every turn, for the current observation, shown in front of it: the authors'
    ``turn_based``) or ``both``. An entry that guided several turns of an episode is credited once
    for it."""
    entries_per_episode: int = 1
    """Entries a guided episode is shown at its start (the authors' ``memory_fetch_num``; 1 = the
    paper, and the authors' MiniHack run), from one batched search re-ranked one after another; each
    is credited once for the episode."""
    warmup_steps: int = 0
    """Rollout steps before retrieval starts (the authors' ``memory_warmup_interval``): below it
    every copy runs free and the bank only grows. 0 = off (the paper)."""

    def __post_init__(self) -> None:
        check_choices(self, "experience")
        if isinstance(self.seed_entries, dict):
            per_env: dict[str, tuple[str, ...]] = {}
            for env_id, texts in self.seed_entries.items():
                if (
                    not isinstance(env_id, str)
                    or isinstance(texts, str)
                    or not isinstance(texts, (list, tuple))
                    or not all(isinstance(t, str) for t in texts)
                ):
                    raise ConfigError(
                        f"experience.seed_entries[{env_id!r}]: expected a list of texts, "
                        f"got {texts!r}"
                    )
                per_env[env_id] = tuple(texts)
            object.__setattr__(self, "seed_entries", per_env)
        if self.entries_per_episode < 1:
            raise ConfigError(
                f"experience.entries_per_episode must be >= 1, got {self.entries_per_episode}"
            )
        if self.warmup_steps < 0:
            raise ConfigError(f"experience.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.embed_dim < 8:
            raise ConfigError(f"experience.embed_dim must be >= 8, got {self.embed_dim}")
        if not 0 < self.distill_fraction <= 1:
            raise ConfigError(
                f"experience.distill_fraction must be in (0, 1], got {self.distill_fraction}"
            )
        if self.distill_per_group < 0:
            raise ConfigError(
                f"experience.distill_per_group must be >= 0 (0 = off), got {self.distill_per_group}"
            )
        if self.distill_per_group and self.distill_fraction < 1:
            raise ConfigError(
                "experience.distill_per_group and experience.distill_fraction < 1 are two "
                "distillation "
                "rules; set one (distill_per_group > 0 with distill_fraction 1, or "
                "distill_per_group 0)"
            )
        if self.distill_linger_s < 0:
            raise ConfigError(
                f"experience.distill_linger_s must be >= 0, got {self.distill_linger_s}"
            )
        if not 0 <= self.extractor_nice <= 19:
            raise ConfigError(
                f"experience.extractor_nice must be in [0, 19], got {self.extractor_nice}"
            )
        for name in (
            "max_search_calls",
            "distill_batch",
            "actor_threads",
            "extractor_threads",
            "max_prompt_chars",
            "max_ops",
        ):
            if getattr(self, name) < (0 if name == "max_search_calls" else 1):
                raise ConfigError(f"experience.{name} is out of range: {getattr(self, name)}")
        if self.max_entry_chars is not None and self.max_entry_chars < 1:
            raise ConfigError(
                f"experience.max_entry_chars must be >= 1 or null, got {self.max_entry_chars}"
            )
        if not 0 <= self.action_slot <= MAX_ACTION_SLOT:
            raise ConfigError(
                f"experience.action_slot must be in [0, {MAX_ACTION_SLOT}] (0 = off), got "
                f"{self.action_slot}"
            )
        for name in ("actor_cpus", "extractor_cpus"):
            cpus = getattr(self, name)
            if cpus is not None and (not cpus or min(cpus) < 0):
                raise ConfigError(
                    f"experience.{name} must list core numbers >= 0, got {list(cpus)}"
                )
        if (
            self.actor_cpus
            and self.extractor_cpus
            and set(self.actor_cpus) & set(self.extractor_cpus)
        ):
            raise ConfigError(
                f"experience.actor_cpus {list(self.actor_cpus)} and experience.extractor_cpus "
                f"{list(self.extractor_cpus)} overlap: each track needs its own cores"
            )

    def seeds_for(self, env_ids: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
        """``(text, tags)`` of the seed entries for a run on ``env_ids``: a list's texts untagged, a
        mapping's texts of those ids only, each tagged with its id."""
        if not isinstance(self.seed_entries, dict):
            return [(text, ()) for text in self.seed_entries]
        return [
            (text, (env_id,)) for env_id in env_ids for text in self.seed_entries.get(env_id, ())
        ]
