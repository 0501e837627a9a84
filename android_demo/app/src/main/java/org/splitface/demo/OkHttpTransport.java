package org.splitface.demo;

import java.util.concurrent.TimeUnit;
import okhttp3.OkHttpClient;
import okhttp3.Request;
import okhttp3.Response;
import okhttp3.WebSocket;
import okhttp3.WebSocketListener;
import okio.ByteString;
import org.splitface.core.Inbox;
import org.splitface.core.Tls;
import org.splitface.core.Transport;
import org.splitface.core.UntrustedServer;

/**
 * The core's Transport over OkHttp's websocket client (java.net.http does not exist on Android). wss:// trusts
 * the CAs of {@link Tls} and OkHttp checks the host name. OkHttp cannot bound a message while reading it: one over
 * the limit is refused (1009) once read.
 */
final class OkHttpTransport extends WebSocketListener implements Transport {
    private final Inbox inbox = new Inbox();
    private final String url;
    private volatile long maxMessageBytes;
    private volatile String untrusted;   // the certificate problem that ended the connection, if any
    private WebSocket socket;

    private OkHttpTransport(String url) { this.url = url; }

    /** tls: from {@link Tls#forUrl} (null: plain ws://, which forUrl allows only on loopback or when asked). */
    static Transport.Factory factory(Tls tls) {
        OkHttpClient.Builder builder = new OkHttpClient.Builder().readTimeout(0, TimeUnit.MILLISECONDS);
        if (tls != null) builder.sslSocketFactory(tls.context.getSocketFactory(), tls.trustManager);
        OkHttpClient client = builder.build();
        return (url, maxBytes) -> {
            OkHttpTransport t = new OkHttpTransport(url);
            t.maxMessageBytes(maxBytes);
            t.socket = client.newWebSocket(new Request.Builder().url(url).build(), t);
            return t;   // a failed connect shows up on the first receive
        };
    }

    @Override public void maxMessageBytes(long limit) {
        if (limit < 1) throw new IllegalArgumentException("max_message_bytes must be positive, not " + limit);
        maxMessageBytes = limit;
    }

    @Override public void send(byte[] message) throws ConnectionLost {
        if (!socket.send(ByteString.of(message))) throw new ConnectionLost(inbox.reason());
    }

    @Override public byte[] receive(long timeoutMs) throws ConnectionLost {
        try {
            return inbox.take(timeoutMs);
        } catch (ConnectionLost e) {
            if (untrusted != null) throw new UntrustedServer(url, untrusted);
            throw e;
        }
    }

    @Override public void close() { socket.close(1000, "bye"); }

    @Override public void onMessage(WebSocket ws, ByteString bytes) {
        if (bytes.size() > maxMessageBytes) {
            inbox.closed("server message exceeds this device's limit of " + maxMessageBytes + " bytes (closed: 1009)");
            ws.close(1009, "message too big");
            return;
        }
        inbox.deliver(bytes.toByteArray());
    }

    @Override public void onMessage(WebSocket ws, String text) { inbox.closed("server sent a text frame"); }

    @Override public void onClosing(WebSocket ws, int code, String reason) {
        inbox.closed("server closed the connection (" + code + (reason.isEmpty() ? "" : ": " + reason) + ")");
    }

    @Override public void onFailure(WebSocket ws, Throwable t, Response response) {
        untrusted = Tls.certificateProblem(t);
        inbox.closed("connection lost: " + t.getMessage());
    }
}
