"""What an engine reports about itself: the rewrites it made and its speculation counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Report:
    """What `optimize()` did to the target, in the words of API.md.

    Attributes:
        passes: pass name -> matches in the target's decode-step graph.
        fused_ops: fuser op name -> count in the target's decode-step graph (T = 1).
        graphs: graph name ("target.prefill", "target.decode", ...) -> fuser op counts.
        fallbacks: what runs in eager PyTorch, and why.
        graph_replays: graph name -> CUDA graph replays so far.
        compile_seconds: time spent in capture, passes and compilation.
    """

    passes: dict[str, int] = field(default_factory=dict)
    fused_ops: dict[str, int] = field(default_factory=dict)
    graphs: dict[str, dict[str, int]] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    graph_replays: dict[str, int] = field(default_factory=dict)
    compile_seconds: float = 0.0

    def __str__(self) -> str:
        lines = [f"compile: {self.compile_seconds:.1f} s"]
        lines.append("passes (target decode graph):")
        lines += [f"  {name:<24} {n:>6}" for name, n in self.passes.items()] or ["  (none)"]
        lines.append("fused ops per graph:")
        for graph, ops in self.graphs.items():
            body = ", ".join(f"{op} x{n}" for op, n in sorted(ops.items())) or "(none)"
            lines.append(f"  {graph:<24} {body}")
        if self.graph_replays:
            lines.append("CUDA graph replays:")
            lines += [f"  {g:<24} {n:>6}" for g, n in self.graph_replays.items()]
        lines.append("fallbacks:")
        lines += [f"  - {f}" for f in self.fallbacks] or ["  (none)"]
        return "\n".join(lines)


@dataclass
class SpecStats:
    """Speculative-decoding counters, named as vLLM names them; cumulative until `reset()`."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_generated_tokens: int = 0
    generate_seconds: float = 0.0
    gamma: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target forward: 1 + accepted / drafts (1.0 without speculation)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of `generate`/`stream` wall time."""
        return self.num_generated_tokens / self.generate_seconds if self.generate_seconds else 0.0

    def reset(self) -> None:
        """Zero every counter (gamma stays)."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * len(self.accepted_per_position)
        self.num_generated_tokens = 0
        self.generate_seconds = 0.0
