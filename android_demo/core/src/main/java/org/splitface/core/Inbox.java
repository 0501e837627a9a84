package org.splitface.core;

import java.util.concurrent.BlockingQueue;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;

/** Received websocket messages for a blocking reader, and the reason once the connection is gone. */
public final class Inbox {
    private static final Object CLOSED = new Object();
    private final BlockingQueue<Object> queue = new LinkedBlockingQueue<>();
    private volatile String closeReason = "connection closed";

    public void deliver(byte[] message) { queue.add(message); }

    /** The connection is gone; every later {@link #take} throws with this reason. */
    public void closed(String reason) {
        closeReason = reason;
        queue.add(CLOSED);
    }

    public String reason() { return closeReason; }

    public byte[] take(long timeoutMs) throws Transport.ConnectionLost {
        Object m;
        try {
            m = queue.poll(timeoutMs, TimeUnit.MILLISECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new Transport.ConnectionLost("interrupted");
        }
        if (m == null) throw new Transport.ConnectionLost("no reply within " + timeoutMs + " ms");
        if (m == CLOSED) { queue.add(CLOSED); throw new Transport.ConnectionLost(closeReason); }
        return (byte[]) m;
    }
}
