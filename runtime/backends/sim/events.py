"""Streams and events of the sim backend: waits, records, queries and host synchronization, each
also told to the race checker; the layer of `SimBackend` over its access notes (state.py)."""

from __future__ import annotations

import torch

from pytest_graphmode.runtime.backends.sim.access_notes import AccessNotes
from pytest_graphmode.runtime.backends.sim.streams import SimEvent, SimStream, new_marker, new_wait
from pytest_graphmode.runtime.backends.sim.threads import serialized


class StreamsAndEvents(AccessNotes):
    """torch.cuda's stream and event calls, as the sim's scheduler and race checker see them."""

    @serialized
    def stream_wait_event(self, stream: SimStream, event: SimEvent) -> None:
        active = self._active
        if active is not None and event.capture_position is not None:
            owner, position = event.capture_position
            if owner is active:
                forks = stream not in active.unjoined
                active.capture.order.waited(stream, event.capture_point, forks)
                if forks:
                    active.unjoined[stream] = True  # forked into the capture
                    active.ops_on[stream] = 0
                elif event.recorded_on is not None and position == active.ops_on.get(
                    event.recorded_on
                ):
                    active.unjoined[event.recorded_on] = False
                return
        self._check_captured_record(event, "a stream's wait")
        marker = event.marker
        if active is not None and stream in active.unjoined and marker is not None:
            raise active.capture.fail(
                "a capturing stream waited on an event recorded outside the capture "
                "(cudaErrorStreamCaptureIsolation): a graph cannot depend on uncaptured work; "
                "record the event inside the capture, or wait before capturing"
            )
        if event.clock is not None:
            self._races.wait(self._races.agent(stream), event.clock)
        if marker is None or marker.done:
            return
        self.scheduler.enqueue(stream, new_wait(marker))

    @serialized
    def event_record(self, event: SimEvent, stream: SimStream | None) -> None:
        stream = stream or self._current
        event.recorded_on = stream
        active = self._active
        if active is not None and stream in active.unjoined:
            event.capture_position = (active, active.ops_on[stream])
            event.capture_point = active.capture.order.recorded(stream)
            event.marker = None
            event.clock = None
            if event.external:
                active.capture.records_external(event)
            return
        event.capture_position = event.capture_point = None
        event.marker = new_marker(stream)
        event.clock = self._races.record(self._races.agent(stream))
        self.scheduler.enqueue(stream, event.marker)

    @staticmethod
    def _check_captured_record(event: SimEvent, what: str) -> None:
        """CUDA refuses to wait for or on an event whose last record is a node of a graph (a
        record inside a capture), unless the event was made with external=True."""
        if event.capture_position is not None and not event.external:
            raise RuntimeError(
                f"invalid argument (as CUDA reports it): {what} of an event last recorded inside a graph "
                "capture; make it with torch.cuda.Event(external=True) to use it outside the "
                "graph, or record it again outside"
            )

    @serialized
    def event_query(self, event: SimEvent) -> bool:
        self._forbid_in_capture("Event.query()", event.recorded_on or self._current)
        self._check_captured_record(event, "Event.query()")
        self.scheduler.maybe_progress()
        done = event.marker is None or event.marker.done
        if done and event.clock is not None:
            self._races.host_waits(event.clock)  # the host saw it complete
        return done

    @serialized
    def event_synchronize(self, event: SimEvent) -> None:
        self._forbid_in_capture("Event.synchronize()", event.recorded_on or self._current)
        self._check_captured_record(event, "Event.synchronize()")
        if event.marker is not None:
            self.scheduler.run_until(event.marker)
        if event.clock is not None:
            self._races.host_waits(event.clock)

    @serialized
    def stream_query(self, stream: SimStream) -> bool:
        self._forbid_in_capture("Stream.query()", stream)
        self.scheduler.maybe_progress()
        done = not self.scheduler.has_work(stream)
        if done:
            self._races.host_waits_for(self._races.agent(stream))
        return done

    @serialized
    def stream_synchronize(self, stream: SimStream) -> None:
        self._forbid_in_capture("Stream.synchronize()", stream)
        self._host_waits_for(stream)

    @serialized
    def host_read(self, what: str, t: torch.Tensor | None = None) -> None:
        """The host is about to read device memory (`t`, when known): in a capture that is
        illegal, else it waits for the current stream, which copies it to the host. The sim's
        own internal work reads nothing for the program."""
        if self._passthrough:
            return
        active = self.capturing_here()
        if active is not None:
            raise active.capture.fail(
                f"{what} cannot be captured: a host read of a device value. Move it out of the "
                "capture region, or keep the value on the device."
            )
        if t is not None:
            self._note(self._current, [(t, False)], what)
        self._host_waits_for(self._current)
