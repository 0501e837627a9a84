package org.splitface.core;

/** A protocol violation detected locally; {@code code} is one of splitface/protocol/SPEC.md's error codes. */
public class ProtocolException extends RuntimeException {
    public static final String BAD_MESSAGE = "bad_message", UNKNOWN_TYPE = "unknown_type", BAD_TENSOR = "bad_tensor",
            TOO_LARGE = "too_large", BAD_STATE = "bad_state", OUT_OF_ORDER = "out_of_order";

    public final String code;
    public final Long batchId;

    public ProtocolException(String code, String message) { this(code, message, null); }

    public ProtocolException(String code, String message, Long batchId) {
        super(code + ": " + message);
        this.code = code;
        this.batchId = batchId;
    }
}
