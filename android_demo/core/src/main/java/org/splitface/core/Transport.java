package org.splitface.core;

import java.io.IOException;

/** One websocket connection carrying binary messages. JVM: {@link JdkWebSocketTransport}; Android: OkHttp. */
public interface Transport extends AutoCloseable {
    /** The connection dropped, or the server closed it (code and reason, as sent, when known). */
    class ConnectionLost extends IOException {
        public ConnectionLost(String message) { super(message); }
    }

    interface Factory {
        Transport open(String url) throws ConnectionLost;
    }

    void send(byte[] message) throws ConnectionLost;

    byte[] receive(long timeoutMs) throws ConnectionLost;

    @Override
    void close();
}
