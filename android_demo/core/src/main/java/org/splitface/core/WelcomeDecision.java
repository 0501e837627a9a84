package org.splitface.core;

import java.util.LinkedHashMap;
import java.util.Map;

/**
 * What a device does after WELCOME (SPEC.md section 10), decided in this one place, as
 * splitface/protocol/client_session.py's welcome_decision: resume at its next batch (re-sending the batch in
 * flight; the server answers it from its cache if it applied it already) or roll back to the server's last
 * applied batch; a WELCOME that cannot be reconciled throws {@link CannotResume}. The shared cases are
 * splitface/protocol/vectors/reconnect/welcome_decisions.json.
 */
public final class WelcomeDecision {
    public enum Kind { RESUME, ROLLBACK }

    /** WELCOME's progress cannot be reconciled with the device's: the device must stop. */
    public static final class CannotResume extends ProtocolException {
        /** "server_ahead" (a batch this device never sent: it lost its state) or "durable_ahead". */
        public final String reason;
        /** The message without its code. */
        public final String detail;
        public final long serverApplied, committed;

        CannotResume(String reason, String message, long serverApplied, long committed) {
            super(BAD_STATE, message);
            this.reason = reason; this.detail = message; this.serverApplied = serverApplied; this.committed = committed;
        }
    }

    public final Kind kind;
    /** Resume: the batch to send next (committed + 1). Rollback: batchId + 1. */
    public final long nextBatch;
    /** Rollback: the batch whose snapshot to restore (the server's last applied). Resume: nextBatch - 1. */
    public final long batchId;
    /** Resume: the device holds the next batch's FORWARD (in flight) and re-sends those exact bytes. */
    public final boolean resend;
    /** Resume: the server applied the next batch already; it answers with its cached BACKWARD, applying nothing. */
    public final boolean replay;
    /** Snapshots of batches before this one can never be needed (SPEC.md section 11). */
    public final long forgetBefore;

    private WelcomeDecision(Kind kind, long batchId, boolean resend, boolean replay, long forgetBefore) {
        this.kind = kind; this.batchId = batchId; this.nextBatch = batchId + 1;
        this.resend = resend; this.replay = replay; this.forgetBefore = forgetBefore;
    }

    /**
     * committed: the device's last committed batch (C); inFlight: the batch whose FORWARD it holds unanswered (null, or
     * C + 1); resumeFrom, durableThrough: WELCOME's fields.
     */
    public static WelcomeDecision decide(long committed, Long inFlight, long resumeFrom, long durableThrough) {
        if (inFlight != null && inFlight != committed + 1)
            throw new IllegalArgumentException("the batch in flight is " + inFlight + ", but only batch " + (committed + 1)
                    + " can be (committed: " + committed + ")");
        long applied = resumeFrom - 1;
        if (applied > committed + 1)
            throw new CannotResume("server_ahead", "server has applied batch " + applied + ", device only " + committed,
                    applied, committed);
        if (durableThrough > applied)
            throw new CannotResume("durable_ahead", "server's checkpoint covers batch " + durableThrough
                    + ", but it has applied only " + applied, applied, committed);
        long forgetBefore = Math.min(durableThrough, committed);
        if (applied < committed) return new WelcomeDecision(Kind.ROLLBACK, applied, false, false, forgetBefore);
        return new WelcomeDecision(Kind.RESUME, committed, inFlight != null, applied == committed + 1, forgetBefore);
    }

    /** The decision as the vectors spell it. */
    public Map<String, Object> toMap() {
        Map<String, Object> m = new LinkedHashMap<>();
        if (kind == Kind.RESUME) {
            m.put("type", "resume");
            m.put("next_batch", nextBatch);
            m.put("resend", resend);
            m.put("replay", replay);
        } else {
            m.put("type", "rollback");
            m.put("batch_id", batchId);
        }
        m.put("forget_before", forgetBefore);
        return m;
    }

    @Override
    public String toString() { return toMap().toString(); }
}
