package org.splitface.demo;

import java.util.concurrent.BlockingQueue;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import okhttp3.OkHttpClient;
import okhttp3.Request;
import okhttp3.Response;
import okhttp3.WebSocket;
import okhttp3.WebSocketListener;
import okio.ByteString;
import org.splitface.core.Transport;

/** The core's Transport over OkHttp's websocket client (java.net.http does not exist on Android). */
final class OkHttpTransport extends WebSocketListener implements Transport {
    private static final Object CLOSED = new Object();
    private static final OkHttpClient CLIENT = new OkHttpClient.Builder().readTimeout(0, TimeUnit.MILLISECONDS).build();
    private final BlockingQueue<Object> inbox = new LinkedBlockingQueue<>();
    private volatile String closeReason = "connection closed";
    private WebSocket socket;

    static Transport.Factory factory() {
        return url -> {
            OkHttpTransport t = new OkHttpTransport();
            t.socket = CLIENT.newWebSocket(new Request.Builder().url(url).build(), t);
            return t;   // a failed connect shows up as ConnectionLost on the first receive
        };
    }

    @Override public void send(byte[] message) throws ConnectionLost {
        if (!socket.send(ByteString.of(message))) throw new ConnectionLost(closeReason);
    }

    @Override public byte[] receive(long timeoutMs) throws ConnectionLost {
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

    @Override public void close() { socket.close(1000, "bye"); }

    @Override public void onMessage(WebSocket ws, ByteString bytes) { inbox.add(bytes.toByteArray()); }

    @Override public void onMessage(WebSocket ws, String text) {
        closeReason = "server sent a text frame";
        inbox.add(CLOSED);
    }

    @Override public void onClosing(WebSocket ws, int code, String reason) {
        closeReason = "server closed the connection (" + code + (reason.isEmpty() ? "" : ": " + reason) + ")";
        inbox.add(CLOSED);
    }

    @Override public void onFailure(WebSocket ws, Throwable t, Response response) {
        closeReason = "connection lost: " + t.getMessage();
        inbox.add(CLOSED);
    }
}
