"""Lingering close: a connection's last answer is not lost to a reset.

When a connection is closed while bytes its client sent wait unread (a request
pipelined behind one that ends the connection, a malformed head aiohttp answers
400, junk sent ahead of a fill), close(2) makes the kernel reset the connection,
and a reset drops whatever of the last answer is still queued to be sent: a
client that had not read a 1 MiB answer yet gets part of it and an error. nginx
avoids this with its lingering close, and so does the edge: the socket is kept
(a duplicate descriptor, so that asyncio's close of its own does not end the
connection), half-closed (a FIN queued behind the answer), and read to its end
and discarded. It is then closed once the client has closed too, which is when a
well-behaved client has read the answer, or after :data:`LINGER_S` at most,
whatever the client sends.

Only a connection with unread bytes lingers: the others close at once. A process
holds at most :data:`MAX_LINGERING` lingering sockets, and reads at most
:data:`READ_PER_WAKE` bytes of one in a turn of the event loop, so that clients
sending without end cannot hold descriptors or the loop.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import socket
import termios
from collections.abc import Callable

#: How long a closed connection is read and discarded, at most (nginx's
#: ``lingering_time`` is 30 s; its clients' answers are as short as the edge's).
LINGER_S = 5.0
#: Sockets lingering at once in a process, at most; beyond, a close resets as before.
#: (Each holds one descriptor: within the room :func:`.server.connection_limit` leaves.)
MAX_LINGERING = 64
#: Bytes read from one lingering socket in a turn of the event loop, at most: what
#: asyncio's own transports read a turn.
READ_PER_WAKE = 256 << 10

# each lingering socket: its event loop, and what ends its lingering
_lingering: dict[socket.socket, tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = {}
_discard = bytearray(64 << 10)  # what lingering sockets read, never looked at


def unread(sock: socket.socket) -> int:
    """Bytes the client sent that wait in ``sock``, unread (0 if it cannot tell)."""
    count = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, count, True)
    except (OSError, ValueError):
        return 0
    return count[0]


def linger(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bool:
    """Keep ``sock``'s connection open past its owner's close if its client's bytes wait
    unread: half-closed, read and discarded until the client closes or :data:`LINGER_S`
    pass. Whether it lingers. Call it before the owner closes ``sock``, on ``loop``."""
    _forget_closed_loops()
    if len(_lingering) >= MAX_LINGERING or not unread(sock):
        return False
    try:
        held = sock.dup()  # the connection ends when both descriptors are closed
    except OSError:
        return False
    try:
        held.setblocking(False)
        held.shutdown(socket.SHUT_WR)  # a FIN behind what is queued: the answer ends whole
    except OSError:
        held.close()
        return False
    ended = False

    def end() -> None:
        nonlocal ended
        if ended:
            return
        ended = True
        timer.cancel()
        loop.remove_reader(held.fileno())
        _lingering.pop(held, None)
        held.close()

    def drain() -> None:
        taken = 0
        try:
            while taken < READ_PER_WAKE:
                n = held.recv_into(_discard)
                if not n:  # the client closed: nothing more can be reset away
                    end()
                    return
                taken += n
        except BlockingIOError:
            return
        except OSError:  # the client reset the connection
            end()

    timer = loop.call_later(LINGER_S, end)
    loop.add_reader(held.fileno(), drain)
    _lingering[held] = (loop, end)
    return True


def end_all(loop: asyncio.AbstractEventLoop) -> None:
    """Close every socket lingering on ``loop`` now (its server stops: on ``loop``). A
    loop closed without this keeps its sockets until the process's next :func:`linger`
    or :func:`lingering`."""
    # the snapshot in one call: another thread's loop may change the map (tests run
    # several edges in one process)
    for owner, end in list(_lingering.values()):
        if owner is loop:
            end()


def _forget_closed_loops() -> None:
    """Sockets whose event loop was closed while they lingered (their timers with it):
    closed, so that neither their descriptors nor their places stay taken."""
    for held, (owner, _) in list(_lingering.items()):
        if owner.is_closed():
            _lingering.pop(held, None)
            held.close()


def lingering() -> int:
    """Sockets lingering in this process now."""
    _forget_closed_loops()
    return len(_lingering)
