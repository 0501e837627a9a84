package org.splitface.core;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;

/** The device's side of splitface/protocol/client_session.py: builds messages and checks replies (no I/O). */
public final class ClientSession {
    public final String deviceId, token, split, head;
    public final Map<String, Object> model;
    public final int batchSize;
    public final Integer numClasses;
    public final Map<String, String> encodings;
    public Map<String, Object> welcome;

    public ClientSession(String deviceId, String token, Map<String, Object> model, String split, String head,
                         int batchSize, Integer numClasses, Map<String, String> encodings) {
        this.deviceId = deviceId; this.token = token; this.model = model; this.split = split; this.head = head;
        this.batchSize = batchSize; this.numClasses = numClasses; this.encodings = new LinkedHashMap<>(encodings);
    }

    public byte[] hello() {
        Map<String, Object> m = Messages.message(Messages.HELLO);
        m.put("protocol_version", (long) Messages.PROTOCOL_VERSION);
        m.put("device_id", deviceId);
        m.put("token", token);
        m.put("model", model);
        m.put("split", split);
        m.put("head", head);
        m.put("encodings", new LinkedHashMap<String, Object>(encodings));
        m.put("batch_size", (long) batchSize);
        if (numClasses != null) m.put("num_classes", (long) numClasses);
        return Messages.encode(m);
    }

    /** The WELCOME, whose limits the device must then obey: refused (bad_message) if it has none usable. */
    public Map<String, Object> acceptWelcome(byte[] data) {
        Map<String, Object> w = receive(data, Set.of(Messages.WELCOME), null);
        Map<?, ?> limits = (Map<?, ?>) w.get("limits");
        for (String key : List.of("max_message_bytes", "max_batch")) {
            Object v = limits.get(key);
            if (!(v instanceof Long) || (Long) v <= 0)
                throw new ProtocolException(ProtocolException.BAD_MESSAGE, "welcome: limits need int " + key + " > 0");
        }
        welcome = w;
        return welcome;
    }

    /**
     * What to do after the accepted WELCOME ({@link WelcomeDecision}), given the device's last committed batch and the
     * batch whose FORWARD it holds unanswered (null: none); throws WelcomeDecision.CannotResume if it must stop.
     */
    public WelcomeDecision reconcile(long committed, Long inFlight) {
        if (welcome == null) throw new ProtocolException(ProtocolException.BAD_STATE, "no welcome accepted yet");
        return WelcomeDecision.decide(committed, inFlight, (Long) welcome.get("resume_from"),
                (Long) welcome.get("durable_through"));
    }

    public long maxMessageBytes() {
        if (welcome == null) return Messages.DEFAULT_MAX_MESSAGE_BYTES;
        Object limit = ((Map<?, ?>) welcome.get("limits")).get("max_message_bytes");
        return limit instanceof Long ? (Long) limit : Messages.DEFAULT_MAX_MESSAGE_BYTES;
    }

    public byte[] forward(long batchId, float[] activations, int[] shape, int[] labels, boolean eval) {
        return forward(batchId, activations, shape, labels, eval, null);
    }

    /** FORWARD; spentEpsilon: the device's spent epsilon with this release counted (null: no formal mechanism). */
    public byte[] forward(long batchId, float[] activations, int[] shape, int[] labels, boolean eval, Double spentEpsilon) {
        Map<String, Object> m = Messages.message(Messages.FORWARD);
        m.put("batch_id", batchId);
        m.put("activations", Tensor.encode(activations, shape, encodings.getOrDefault("activations", "f32")));
        if (labels != null) {
            if (head.equals("device")) throw new IllegalArgumentException("device head: labels stay on the device");
            List<Object> ys = new ArrayList<>();
            for (int y : labels) ys.add((long) y);
            m.put("labels", ys);
        }
        if (eval) m.put("eval", true);
        if (spentEpsilon != null) {
            if (!Messages.isSpentEpsilon(spentEpsilon))
                throw new IllegalArgumentException("spent_epsilon must be finite and >= 0, got " + spentEpsilon);
            m.put("spent_epsilon", spentEpsilon);
        }
        return checked(Messages.encode(m));
    }

    public byte[] embeddingGrad(long batchId, float[] grad, int[] shape) {
        Map<String, Object> m = Messages.message(Messages.EMBEDDING_GRAD);
        m.put("batch_id", batchId);
        m.put("grad", Tensor.encode(grad, shape, encodings.getOrDefault("gradients", "f32")));
        return checked(Messages.encode(m));
    }

    private byte[] checked(byte[] data) {
        if (data.length > maxMessageBytes())
            throw new ProtocolException(ProtocolException.TOO_LARGE, "message of " + data.length
                    + " bytes exceeds the server's limit of " + maxMessageBytes());
        return data;
    }

    /** A validated reply of an expected type; ERROR becomes {@link RemoteError}. */
    public Map<String, Object> receive(byte[] data, Set<String> expect, Long batchId) {
        Map<String, Object> m = Messages.decode(data, Math.max(maxMessageBytes(), Messages.DEFAULT_MAX_MESSAGE_BYTES));
        String type = (String) m.get("type");
        if (type.equals(Messages.ERROR))
            throw new RemoteError((String) m.get("code"), (String) m.get("message"), (Long) m.get("batch_id"));
        if (!expect.contains(type)) throw new ProtocolException(ProtocolException.BAD_STATE, "expected " + expect + ", got " + type);
        if (batchId != null && !batchId.equals(m.get("batch_id")))
            throw new ProtocolException(ProtocolException.OUT_OF_ORDER, "reply for batch " + m.get("batch_id") + ", expected " + batchId);
        return m;
    }
}
