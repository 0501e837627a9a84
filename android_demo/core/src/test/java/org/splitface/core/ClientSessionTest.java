package org.splitface.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.fail;

import java.nio.file.Files;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.junit.Test;

/** A WELCOME whose limits the device cannot read is refused (bad_message), as splitface/protocol/client_session.py does. */
public class ClientSessionTest {
    static ClientSession session() {
        return new ClientSession("phone-01", "s3cret-token", new LinkedHashMap<>(), "conv1", "server", 2, 10,
                Map.of("activations", "f32", "gradients", "f32"));
    }

    @SuppressWarnings("unchecked")
    static byte[] welcomeWith(Object limits) throws Exception {
        byte[] vector = Files.readAllBytes(VectorConformanceTest.VECTORS.resolve("03_welcome.msgpack"));
        Map<String, Object> welcome = (Map<String, Object>) Wire.unpack(vector);
        welcome.put("limits", limits);
        return Wire.pack(welcome);
    }

    @Test
    public void acceptsTheVectorsWelcome() throws Exception {
        ClientSession s = session();
        s.acceptWelcome(Files.readAllBytes(VectorConformanceTest.VECTORS.resolve("03_welcome.msgpack")));
        assertEquals(1L << 20, s.maxMessageBytes());
    }

    @Test
    public void refusesAWelcomeWithoutUsableLimits() throws Exception {
        Map<String, Object> noBatch = new LinkedHashMap<>();
        noBatch.put("max_message_bytes", 1024L);
        Map<String, Object> zero = new LinkedHashMap<>(noBatch);
        zero.put("max_batch", 0L);
        Map<String, Object> text = new LinkedHashMap<>();
        text.put("max_message_bytes", "big");
        text.put("max_batch", 2L);
        for (Map<String, Object> limits : List.of(new LinkedHashMap<String, Object>(), noBatch, zero, text)) {
            ClientSession s = session();
            try {
                s.acceptWelcome(welcomeWith(limits));
                fail("accepted limits " + limits);
            } catch (ProtocolException e) {
                assertEquals(ProtocolException.BAD_MESSAGE, e.code);
            }
            assertEquals(null, s.welcome);
        }
    }
}
