"""runtime/scheduler.py's RequestStream on its own (no engine): deliveries wake an async reader
once per wait, not once per delivery, and a reader slower than the deliveries still gets every
token, in order."""

from __future__ import annotations

import asyncio
import threading

from fuser.runtime.scheduler import RequestStream, SamplingParams


def stream() -> RequestStream:
    return RequestStream("r", [1, 2, 3], SamplingParams(max_tokens=1000), eos=[], seed=0)


class CountingLoop:
    """An event loop as `_deliver` sees it: counts the wake-ups it is asked for and runs them."""

    def __init__(self) -> None:
        self.calls = 0

    def call_soon_threadsafe(self, callback) -> None:
        self.calls += 1
        callback()


def test_a_reader_already_woken_is_not_woken_again() -> None:
    s, loop, event = stream(), CountingLoop(), asyncio.Event()
    s._waiters.append((loop, event))
    s._deliver([4])
    s._deliver([5])  # (the event is still set: the reader has not looked yet)
    s._deliver([6])
    assert loop.calls == 1 and event.is_set()
    event.clear()  # the reader looked, found nothing more, and waits again
    s._deliver([7], "length")
    assert loop.calls == 2
    assert list(s._items) == [[4], [5], [6], [7]] and s.output_ids == [4, 5, 6, 7]


def test_a_slow_async_reader_gets_every_token_in_order() -> None:
    s, count = stream(), 2000

    def deliver() -> None:
        for token in range(count):
            s._deliver([token], "length" if token == count - 1 else None)

    async def read() -> list[int]:
        out: list[int] = []
        async for tokens in s:
            out.extend(tokens)
            if len(out) % 97 == 0:
                await asyncio.sleep(0.001)  # (behind the deliveries now and then)
        return out

    async def main() -> list[int]:
        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0)  # (its waiter registered before the deliveries begin)
        thread = threading.Thread(target=deliver)
        thread.start()
        out = await asyncio.wait_for(reader, timeout=60)
        thread.join()
        return out

    assert asyncio.run(main()) == list(range(count))
