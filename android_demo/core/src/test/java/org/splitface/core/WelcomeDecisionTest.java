package org.splitface.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.junit.Test;

/** The device's decision after WELCOME: every case of splitface/protocol/vectors/reconnect/welcome_decisions.json (SPEC.md section 10). */
public class WelcomeDecisionTest {
    @SuppressWarnings("unchecked")
    static List<Map<String, Object>> cases() throws Exception {
        String text = Files.readString(VectorConformanceTest.VECTORS.resolve("reconnect/welcome_decisions.json"),
                StandardCharsets.UTF_8);
        return (List<Map<String, Object>>) ((Map<String, Object>) Json.parse(text)).get("cases");
    }

    @SuppressWarnings("unchecked")
    static byte[] welcome(long resumeFrom, long durableThrough) throws Exception {
        byte[] vector = Files.readAllBytes(VectorConformanceTest.VECTORS.resolve("03_welcome.msgpack"));
        Map<String, Object> welcome = (Map<String, Object>) Wire.unpack(vector);
        welcome.put("resume_from", resumeFrom);
        welcome.put("durable_through", durableThrough);
        return Wire.pack(welcome);
    }

    @Test
    @SuppressWarnings("unchecked")
    public void everyCase() throws Exception {
        Set<String> kinds = new HashSet<>();
        for (Map<String, Object> c : cases()) {
            String name = (String) c.get("name");
            Map<String, Object> device = (Map<String, Object>) c.get("device");
            Map<String, Object> w = (Map<String, Object>) c.get("welcome");
            Map<String, Object> want = (Map<String, Object>) c.get("decision");
            long committed = (Long) device.get("committed");
            Long inFlight = (Long) device.get("in_flight");
            ClientSession session = ClientSessionTest.session();
            session.acceptWelcome(welcome((Long) w.get("resume_from"), (Long) w.get("durable_through")));
            kinds.add((String) want.get("type"));
            if ("invalid".equals(want.get("type"))) {
                try {
                    session.reconcile(committed, inFlight);
                    fail(name + ": reconciled an invalid WELCOME");
                } catch (WelcomeDecision.CannotResume e) {
                    assertEquals(name, want.get("reason"), e.reason);
                    assertEquals(name, want.get("error_code"), e.code);
                }
                continue;
            }
            WelcomeDecision got = session.reconcile(committed, inFlight);
            assertEquals(name, want, got.toMap());
            assertEquals(name, want, WelcomeDecision.decide(committed, inFlight, (Long) w.get("resume_from"),
                    (Long) w.get("durable_through")).toMap());
        }
        assertEquals(Set.of("resume", "rollback", "invalid"), kinds);
    }

    @Test
    public void onlyTheNextBatchCanBeInFlight() {
        try {
            WelcomeDecision.decide(5, 7L, 6, 5);
            fail("accepted batch 7 in flight after 5");
        } catch (IllegalArgumentException e) {
            assertTrue(e.getMessage(), e.getMessage().contains("only batch 6"));
        }
    }
}
