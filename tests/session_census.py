"""A workload that counts the sessions it makes, and a census of the live ones as requests
finish: for the tests that a simulator holds the sessions in flight, not every session
(tests/test_sim_stream.py for simulate, tests/test_sim_pd.py for simulate_pd)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from kvpool.workload.sessions import GeneratedSessions, Session, Workload, uniform_workload


@dataclass
class Census:
    workload: Workload
    made: list[int] = field(default_factory=list)  # session indices read, in order
    finished: list = field(default_factory=list)  # the records, as they finish
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (alive, made, finished) every 20

    def on_finish(self, record) -> None:
        self.finished.append(record)
        if len(self.finished) % 20 == 0:  # (no gc.collect: a session dropped is freed by its count)
            alive = sum(1 for o in gc.get_objects() if type(o) is Session and o.session_id.startswith("req"))
            self.samples.append((alive, len(self.made), len(self.finished)))

    def check_in_flight(self, report: dict) -> None:
        """120 requests finished, and at every sample the sessions alive were those made less
        those done (the one finishing is still referenced), a few, streamed in."""
        assert report["num_finished"] == len(self.finished) == 120 and len(self.samples) == 6
        assert all(alive <= num_made - num_done + 1 for alive, num_made, num_done in self.samples)
        assert max(alive for alive, _, _ in self.samples) < 30
        assert self.samples[0][1] < 60  # streamed in: the 20th finish came before the 60th arrival


def census(vocab_size: int) -> Census:
    """120 one-turn sessions at 4 req/s whose every read is counted."""
    s = uniform_workload(120, 4.0, vocab_size, seed=1).sessions
    made: list[int] = []

    class Counted(GeneratedSessions):
        def _make(self, lo, hi):  # (every read: one by index, several by iteration)
            made.extend(range(lo, hi))
            return super()._make(lo, hi)

    counted = Counted(s.kind, s._starts, s.prefixes, s._picks, 1, s._user_lens, s._output_lens, None, s.vocab_size)
    return Census(Workload("u", counted, s.vocab_size), made)
