"""An iterator whose items are made on a thread of its own, one ahead of its consumer.

A colocated learner's batch is mostly a gather from the table's memory map, and a wire
batch mostly a wait for gRPC to receive it, both of which let go of the GIL: made on a
thread of its own, the next batch is read while the learner updates on this one, as a
PyTorch ``DataLoader`` prepares its next batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def read_ahead(source: Iterator[T], cancel: Callable[[], None], name: str) -> Iterator[T]:
    """The items of ``source``, each made on a thread of its own while the consumer holds
    the one before (at most one made ahead); an error of ``source`` is raised in its place,
    after every item made before it.

    Closing the returned iterator calls ``cancel``, which must make a ``source`` that waits
    (on a shard, say) return soon, and joins the thread; ``source`` is closed on its thread.
    """
    room = threading.Semaphore(1)  # items made ahead of the one the consumer holds
    made: queue.SimpleQueue = queue.SimpleQueue()
    gone = threading.Event()

    def produce() -> None:
        try:
            while True:
                room.acquire()
                if gone.is_set():
                    return
                try:
                    item = next(source)
                except StopIteration:
                    made.put((False, None))
                    return
                made.put((True, item))
        except BaseException as e:  # raised to the consumer, in its place
            made.put((False, e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            more, value = made.get()
            if more:
                room.release()  # the next one is made while the consumer works on this one
                yield value
            elif value is None:
                return
            else:
                raise value
    finally:
        gone.set()
        room.release()  # a producer waiting for room wakes, sees the consumer gone
        cancel()
        thread.join()
