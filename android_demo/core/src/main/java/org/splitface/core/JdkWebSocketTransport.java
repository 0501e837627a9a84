package org.splitface.core;

import java.io.ByteArrayOutputStream;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.WebSocket;
import java.nio.ByteBuffer;
import java.time.Duration;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;

/** The JDK's java.net.http websocket client (Java 11+): what the JVM core's tests and CLI use. */
public final class JdkWebSocketTransport implements Transport, WebSocket.Listener {
    private static final Object CLOSED = new Object();
    private final BlockingQueue<Object> inbox = new LinkedBlockingQueue<>();
    private final ByteArrayOutputStream partial = new ByteArrayOutputStream();
    private volatile String closeReason = "connection closed";
    private WebSocket socket;

    public static Transport.Factory factory() { return JdkWebSocketTransport::open; }

    public static Transport open(String url) throws ConnectionLost {
        JdkWebSocketTransport t = new JdkWebSocketTransport();
        try {
            t.socket = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build()
                    .newWebSocketBuilder().buildAsync(URI.create(url), t).get(15, TimeUnit.SECONDS);
        } catch (Exception e) {
            throw new ConnectionLost("cannot connect to " + url + ": " + e.getMessage());
        }
        return t;
    }

    @Override
    public void send(byte[] message) throws ConnectionLost {
        try {
            socket.sendBinary(ByteBuffer.wrap(message), true).get(60, TimeUnit.SECONDS);
        } catch (Exception e) {
            throw new ConnectionLost("send failed: " + e.getMessage());
        }
    }

    @Override
    public byte[] receive(long timeoutMs) throws ConnectionLost {
        Object m;
        try {
            m = inbox.poll(timeoutMs, TimeUnit.MILLISECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new ConnectionLost("interrupted");
        }
        if (m == null) throw new ConnectionLost("no reply within " + timeoutMs + " ms");
        if (m == CLOSED) { inbox.add(CLOSED); throw new ConnectionLost(closeReason); }
        return (byte[]) m;
    }

    @Override
    public void close() {
        if (socket != null && !socket.isOutputClosed()) socket.sendClose(WebSocket.NORMAL_CLOSURE, "bye");
        if (socket != null) socket.abort();
    }

    @Override
    public CompletionStage<?> onBinary(WebSocket ws, ByteBuffer data, boolean last) {
        byte[] chunk = new byte[data.remaining()];
        data.get(chunk);
        partial.write(chunk, 0, chunk.length);
        if (last) { inbox.add(partial.toByteArray()); partial.reset(); }
        ws.request(1);
        return null;
    }

    @Override
    public CompletionStage<?> onText(WebSocket ws, CharSequence data, boolean last) {
        closeReason = "server sent a text frame";
        inbox.add(CLOSED);
        return null;
    }

    @Override
    public CompletionStage<?> onClose(WebSocket ws, int code, String reason) {
        closeReason = "server closed the connection (" + code + (reason.isEmpty() ? "" : ": " + reason) + ")";
        inbox.add(CLOSED);
        return CompletableFuture.completedFuture(null);
    }

    @Override
    public void onError(WebSocket ws, Throwable error) {
        closeReason = "connection lost: " + error.getMessage();
        inbox.add(CLOSED);
    }
}
