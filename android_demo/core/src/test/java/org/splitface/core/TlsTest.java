package org.splitface.core;

import static org.junit.Assert.assertEquals;
import static org.junit.Assert.assertFalse;
import static org.junit.Assert.assertNotNull;
import static org.junit.Assert.assertNull;
import static org.junit.Assert.assertTrue;
import static org.junit.Assert.fail;

import java.nio.file.Files;
import java.nio.file.Path;
import java.security.cert.CertificateException;
import javax.net.ssl.SSLHandshakeException;
import org.junit.Rule;
import org.junit.Test;
import org.junit.rules.TemporaryFolder;

/** The URL rule of splitface/device/connection.py's tls_context; the real handshakes run in tests/test_android_core.py. */
public class TlsTest {
    @Rule public TemporaryFolder tmp = new TemporaryFolder();   // deleted after each test

    static void refused(String url, Path ca, boolean insecure, String words) {
        try {
            Tls.forUrl(url, ca, insecure);
            fail(url + " was accepted");
        } catch (IllegalArgumentException e) {
            assertTrue(e.getMessage(), e.getMessage().contains(words));
        }
    }

    @Test
    public void plainWsOnlyOnLoopbackUnlessInsecure() {
        refused("ws://face-edge.example:8765", null, false, "would send the device token in clear");
        refused("ws://127.0.0.1.nip.io:8765", null, false, "in clear");   // a name, not the loopback literal
        refused("ws://localhost.example:8765", null, false, "in clear");
        refused("ws://10.0.0.2:8765", null, false, "in clear");
        assertNull(Tls.forUrl("ws://face-edge.example:8765", null, true));
        for (String url : new String[] {"ws://127.0.0.1:8765", "ws://127.0.0.2:1", "ws://localhost:1", "ws://[::1]:8765"})
            assertNull(url, Tls.forUrl(url, null, false));
    }

    @Test
    public void otherSchemesAndACaFileForPlainWsAreRefused() throws Exception {
        refused("http://127.0.0.1:8765", null, false, "must start with wss://");
        refused("127.0.0.1:8765", null, false, "must start with wss://");
        Path ca = tmp.newFile().toPath();
        refused("ws://127.0.0.1:8765", ca, false, "a CA file was given for a plain ws:// URL");
    }

    @Test
    public void wssUsesThePlatformsCasOrRefusesABadCaFile() throws Exception {
        Tls platform = Tls.forUrl("wss://face-edge.example", null, false);
        assertNotNull(platform.context);
        assertTrue(platform.trustManager.getAcceptedIssuers().length > 0);
        Path empty = tmp.newFile().toPath();
        refused("wss://face-edge.example", empty, false, "holds no certificate");
        Path junk = tmp.newFile().toPath();
        Files.writeString(junk, "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n");
        refused("wss://face-edge.example", junk, false, "is not PEM certificates");
        refused("wss://face-edge.example", junk.resolveSibling("missing.pem"), false, "cannot read the CA file");
    }

    @Test
    public void aCertificateProblemIsToldApartFromOtherFailures() {
        Exception handshake = new SSLHandshakeException("handshake failed");
        handshake.initCause(new CertificateException("No name matching face-edge.example found"));
        assertEquals("No name matching face-edge.example found",
                Tls.certificateProblem(new java.util.concurrent.ExecutionException(handshake)));
        assertNull(Tls.certificateProblem(new java.net.ConnectException("Connection refused")));
        assertFalse(Tls.isLoopback("example.com"));
    }
}
