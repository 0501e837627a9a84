package org.splitface.core;

import java.io.ByteArrayOutputStream;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.WebSocket;
import java.nio.ByteBuffer;
import java.time.Duration;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionStage;
import java.util.concurrent.TimeUnit;

/** The JDK's java.net.http websocket client (Java 11+): what the JVM core's tests and CLI use. */
public final class JdkWebSocketTransport implements Transport, WebSocket.Listener {
    private final Inbox inbox = new Inbox();
    private final ByteArrayOutputStream partial = new ByteArrayOutputStream();
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
    public byte[] receive(long timeoutMs) throws ConnectionLost { return inbox.take(timeoutMs); }

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
        if (last) { inbox.deliver(partial.toByteArray()); partial.reset(); }
        ws.request(1);
        return null;
    }

    @Override
    public CompletionStage<?> onText(WebSocket ws, CharSequence data, boolean last) {
        inbox.closed("server sent a text frame");
        return null;
    }

    @Override
    public CompletionStage<?> onClose(WebSocket ws, int code, String reason) {
        inbox.closed("server closed the connection (" + code + (reason.isEmpty() ? "" : ": " + reason) + ")");
        return CompletableFuture.completedFuture(null);
    }

    @Override
    public void onError(WebSocket ws, Throwable error) {
        inbox.closed("connection lost: " + error.getMessage());
    }
}
