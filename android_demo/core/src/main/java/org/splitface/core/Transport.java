package org.splitface.core;

import java.io.IOException;

/** One websocket connection carrying binary messages. JVM: {@link JdkWebSocketTransport}; Android: OkHttp. */
public interface Transport extends AutoCloseable {
    /** The connection dropped, or the server closed it (code and reason, as sent, when known). */
    class ConnectionLost extends IOException {
        public ConnectionLost(String message) { super(message); }
    }

    interface Factory {
        /**
         * Connect to {@code url}, accepting server messages of at most {@code maxMessageBytes} (a larger one closes
         * the connection with 1009). Throws {@link UntrustedServer} when the server's certificate is refused.
         */
        Transport open(String url, long maxMessageBytes) throws ConnectionLost;
    }

    /** The largest server message accepted from now on (raised once WELCOME announces the server's limit). */
    void maxMessageBytes(long limit);

    void send(byte[] message) throws ConnectionLost;

    byte[] receive(long timeoutMs) throws ConnectionLost;

    @Override
    void close();
}
