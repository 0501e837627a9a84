package org.splitface.core;

import java.util.Set;

/** An ERROR message from the server, shown to the user in words. */
public class RemoteError extends RuntimeException {
    /** Codes after which the server closes the connection (SPEC: fatal errors). */
    public static final Set<String> FATAL = Set.of("unauthorized", "version_mismatch", "model_mismatch",
            "unsupported", "too_large");

    public final String code;
    public final String detail;
    public final Long batchId;

    public RemoteError(String code, String detail, Long batchId) {
        super("server refused (" + code + "): " + detail);
        this.code = code;
        this.detail = detail;
        this.batchId = batchId;
    }

    public boolean fatal() { return FATAL.contains(code); }
}
