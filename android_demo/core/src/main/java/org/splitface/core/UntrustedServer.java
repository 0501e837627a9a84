package org.splitface.core;

/**
 * The server's TLS certificate does not verify against the trusted CAs or is for another host name; retrying
 * cannot help (as splitface/device/connection.py's UntrustedServer).
 */
public final class UntrustedServer extends RuntimeException {
    public UntrustedServer(String url, String problem) {
        super("TLS certificate of " + url + " not accepted: " + problem);
    }
}
