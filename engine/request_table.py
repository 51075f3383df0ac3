"""The engine's table of unfinished requests: each request's `RequestGroup`, which request a sequence
belongs to, and which requests are prefill-only (their KV is exported after the first token).

It ends requests (abort, error, finish) and turns a step's progressed sequences into `RequestOutput`s;
every sequence it ends goes through the scheduler's `finish` so its KV blocks and adapter pin are freed.
"""

from __future__ import annotations

from collections import abc
from collections.abc import Callable

from engine.engine_adapters import SequenceError
from engine.outputs import RequestOutput
from engine.request_group import RequestGroup
from engine.sequence import Sequence, SequenceStatus

Finish = Callable[[Sequence, SequenceStatus], None]


class RequestTable:
    def __init__(self, finish: Finish) -> None:
        self.finish = finish  # the scheduler's `finish_request`
        self.groups: dict[str, RequestGroup] = {}
        self.seq_to_group: dict[str, str] = {}
        self.prefill_only: set[str] = set()  # requests whose KV is exported after their first token

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: RequestGroup, prefill_only: bool = False) -> None:
        """Record `group` and map each of its sequences to it."""
        self.groups[group.request_id] = group
        for s in group.seqs:
            self.seq_to_group[s.seq_id] = group.request_id
        if prefill_only:
            self.prefill_only.add(group.request_id)

    def group_id(self, seq: Sequence) -> str | None:
        """The id of the unfinished request `seq` belongs to, or None."""
        gid = self.seq_to_group.get(seq.seq_id)
        return gid if gid is not None and gid in self.groups else None

    def abort(self, request_id: str | abc.Sequence[str]) -> None:
        """Finish every sequence of the request(s) as aborted and forget them; unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.groups.pop(rid, None)
            self.prefill_only.discard(rid)
            if group is None:
                continue
            for seq in group.seqs:
                self.seq_to_group.pop(seq.seq_id, None)
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def forget(self, gid: str) -> None:
        """Drop finished request `gid` from the table (its sequences are already finished)."""
        self.prefill_only.discard(gid)
        group = self.groups.pop(gid, None)
        if group is not None:
            for s in group.seqs:
                self.seq_to_group.pop(s.seq_id, None)

    def end_with_error(self, gid: str, error: str) -> RequestOutput:
        """End every sequence of group `gid` (freeing its KV blocks and adapter pin) and report `error`."""
        group = self.groups[gid]
        self.abort(gid)
        out = group.output()
        out.error = error
        return out

    def end_all(self, errors: list[SequenceError], refused: bool = False) -> list[RequestOutput]:
        """End the request of each sequence named, once, with its error (`refused`: the request's own
        fault, `RequestOutput.refused`)."""
        ended: dict[str, RequestOutput] = {}
        for seq, error in errors:
            gid = self.group_id(seq)
            if gid is not None and gid not in ended:
                ended[gid] = self.end_with_error(gid, error)
                ended[gid].refused = refused
        return list(ended.values())

    def collect(
        self,
        progressed: abc.Sequence[Sequence],
        export: Callable[[RequestGroup, RequestOutput], RequestOutput],
    ) -> list[RequestOutput]:
        """The outputs of the requests whose sequences progressed this step: detokenize each sequence's
        new tokens (a failure ends only its request, with an error), report each touched request once,
        `export` a prefill-only request that did not finish on its first token, and forget the finished."""
        outputs: list[RequestOutput] = []
        touched: dict[str, RequestGroup] = {}
        for seq in progressed:
            gid = self.seq_to_group.get(seq.seq_id)
            if gid is None:
                continue
            group = self.groups[gid]
            try:
                group.detokenize(seq, self.finish)
            except Exception as exc:
                outputs.append(self.end_with_error(gid, f"detokenization failed: {exc!r}"))
                touched.pop(gid, None)
                continue
            touched[gid] = group
        for gid, group in touched.items():
            if gid not in self.groups:
                continue
            ro = group.output()
            if gid in self.prefill_only:
                self.prefill_only.discard(gid)
                if not ro.finished:
                    ro = export(group, ro)
            outputs.append(ro)
            if ro.finished:
                self.forget(gid)
        return outputs
