package org.splitface.demo;

import java.util.concurrent.TimeUnit;
import okhttp3.OkHttpClient;
import okhttp3.Request;
import okhttp3.Response;
import okhttp3.WebSocket;
import okhttp3.WebSocketListener;
import okio.ByteString;
import org.splitface.core.Inbox;
import org.splitface.core.Transport;

/** The core's Transport over OkHttp's websocket client (java.net.http does not exist on Android). */
final class OkHttpTransport extends WebSocketListener implements Transport {
    private static final OkHttpClient CLIENT = new OkHttpClient.Builder().readTimeout(0, TimeUnit.MILLISECONDS).build();
    private final Inbox inbox = new Inbox();
    private WebSocket socket;

    static Transport.Factory factory() {
        return url -> {
            OkHttpTransport t = new OkHttpTransport();
            t.socket = CLIENT.newWebSocket(new Request.Builder().url(url).build(), t);
            return t;   // a failed connect shows up as ConnectionLost on the first receive
        };
    }

    @Override public void send(byte[] message) throws ConnectionLost {
        if (!socket.send(ByteString.of(message))) throw new ConnectionLost(inbox.reason());
    }

    @Override public byte[] receive(long timeoutMs) throws ConnectionLost { return inbox.take(timeoutMs); }

    @Override public void close() { socket.close(1000, "bye"); }

    @Override public void onMessage(WebSocket ws, ByteString bytes) { inbox.deliver(bytes.toByteArray()); }

    @Override public void onMessage(WebSocket ws, String text) { inbox.closed("server sent a text frame"); }

    @Override public void onClosing(WebSocket ws, int code, String reason) {
        inbox.closed("server closed the connection (" + code + (reason.isEmpty() ? "" : ": " + reason) + ")");
    }

    @Override public void onFailure(WebSocket ws, Throwable t, Response response) {
        inbox.closed("connection lost: " + t.getMessage());
    }
}
