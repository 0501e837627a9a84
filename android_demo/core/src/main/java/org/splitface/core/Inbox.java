package org.splitface.core;

import java.util.concurrent.BlockingQueue;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;

/** Received websocket messages for a blocking reader, and the reason once the connection is gone. */
public final class Inbox {
    private static final Object CLOSED = new Object();
    private final BlockingQueue<Object> queue = new LinkedBlockingQueue<>();
    private volatile String closeReason;

    public void deliver(byte[] message) { queue.add(message); }

    /** The connection is gone; every later {@link #take} throws with this reason (the first given: the cause). */
    public synchronized void closed(String reason) {
        if (closeReason != null) return;
        closeReason = reason;
        queue.add(CLOSED);
    }

    public String reason() { return closeReason == null ? "connection closed" : closeReason; }

    public byte[] take(long timeoutMs) throws Transport.ConnectionLost {
        Object m;
        try {
            m = queue.poll(timeoutMs, TimeUnit.MILLISECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new Transport.ConnectionLost("interrupted");
        }
        if (m == null) throw new Transport.ConnectionLost("no reply within " + timeoutMs + " ms");
        if (m == CLOSED) { queue.add(CLOSED); throw new Transport.ConnectionLost(reason()); }
        return (byte[]) m;
    }
}
