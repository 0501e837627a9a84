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
import javax.net.ssl.SSLParameters;

/**
 * The JDK's java.net.http websocket client (Java 11+): what the JVM core's tests and CLI use. wss:// verifies the
 * server's certificate and host name (the JDK's HTTPS endpoint identification); a server message larger than the
 * limit closes the connection (1009) before it is buffered whole.
 */
public final class JdkWebSocketTransport implements Transport, WebSocket.Listener {
    /** The most a byte[] can hold: a larger announced limit is clipped to it. */
    static final long ARRAY_MAX = Integer.MAX_VALUE - 8;

    private final Inbox inbox = new Inbox();
    private final ByteArrayOutputStream partial = new ByteArrayOutputStream();
    private volatile long maxMessageBytes;
    private volatile boolean tooLarge;
    private WebSocket socket;

    /** tls: from {@link Tls#forUrl} (null: plain ws://, or wss:// against the platform's CAs). */
    public static Transport.Factory factory(Tls tls) { return (url, maxBytes) -> open(url, tls, maxBytes); }

    public static Transport open(String url, Tls tls, long maxMessageBytes) throws ConnectionLost {
        JdkWebSocketTransport t = new JdkWebSocketTransport();
        t.maxMessageBytes(maxMessageBytes);
        HttpClient.Builder http = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10));
        if (tls != null) {
            SSLParameters params = tls.context.getDefaultSSLParameters();
            params.setEndpointIdentificationAlgorithm("HTTPS");   // host name checks on (the JDK's default, made explicit)
            http.sslContext(tls.context).sslParameters(params);
        }
        try {
            t.socket = http.build().newWebSocketBuilder().buildAsync(URI.create(url), t).get(15, TimeUnit.SECONDS);
        } catch (Exception e) {
            String problem = Tls.certificateProblem(e);
            if (problem != null) throw new UntrustedServer(url, problem);
            throw new ConnectionLost("cannot connect to " + url + ": " + e.getMessage());
        }
        return t;
    }

    @Override
    public void maxMessageBytes(long limit) {
        if (limit < 1) throw new IllegalArgumentException("max_message_bytes must be positive, not " + limit);
        maxMessageBytes = Math.min(limit, ARRAY_MAX);
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
        if (tooLarge) return null;
        if ((long) partial.size() + data.remaining() > maxMessageBytes) {   // refused before it is held whole
            tooLarge = true;
            partial.reset();
            inbox.closed("server message exceeds this device's limit of " + maxMessageBytes + " bytes (closed: 1009)");
            ws.sendClose(1009, "message too big");
            ws.abort();
            return null;
        }
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
