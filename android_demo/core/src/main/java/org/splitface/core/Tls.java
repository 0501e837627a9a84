package org.splitface.core;

import java.io.IOException;
import java.io.InputStream;
import java.net.InetAddress;
import java.net.URI;
import java.net.URISyntaxException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.GeneralSecurityException;
import java.security.KeyStore;
import java.security.cert.Certificate;
import java.security.cert.CertificateException;
import java.security.cert.CertificateFactory;
import java.util.Collection;
import java.util.Locale;
import java.util.regex.Pattern;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManager;
import javax.net.ssl.TrustManagerFactory;
import javax.net.ssl.X509TrustManager;

/**
 * The TLS settings for a server URL, with the rule of splitface/device/connection.py's tls_context: wss:// verifies the
 * server's certificate (against a CA file, else the platform's CAs) and its host name; plain ws:// sends the
 * device token in clear, so it is refused unless the host is loopback or insecure is asked for explicitly.
 * OkHttp needs the trust manager beside the context, so both are kept.
 */
public final class Tls {
    private static final Pattern IPV4 = Pattern.compile("\\d{1,3}(\\.\\d{1,3}){3}");

    public final SSLContext context;
    public final X509TrustManager trustManager;

    private Tls(SSLContext context, X509TrustManager trustManager) {
        this.context = context;
        this.trustManager = trustManager;
    }

    /**
     * The settings for {@code url}: null for an allowed plain ws:// URL. caFile: PEM certificates trusted for a
     * wss:// server (null: the platform's CAs). Throws IllegalArgumentException for a URL the rule refuses.
     */
    public static Tls forUrl(String url, Path caFile, boolean insecure) {
        URI uri;
        try {
            uri = new URI(url);
        } catch (URISyntaxException e) {
            throw new IllegalArgumentException(url + ": not a URL (" + e.getReason()
                    + "); the server URL must start with wss:// (or ws:// on loopback)");
        }
        String scheme = uri.getScheme() == null ? "" : uri.getScheme().toLowerCase(Locale.ROOT);
        if (scheme.equals("wss")) return trusting(caFile);
        if (!scheme.equals("ws"))
            throw new IllegalArgumentException(url + ": the server URL must start with wss:// (or ws:// on loopback)");
        if (caFile != null)
            throw new IllegalArgumentException(url + ": a CA file was given for a plain ws:// URL; use wss://");
        if (!insecure && !isLoopback(uri.getHost() == null ? "" : uri.getHost()))
            throw new IllegalArgumentException(url + ": plain ws:// to a non-loopback host would send the device token "
                    + "in clear; use wss:// (with a CA file), or allow it explicitly (--insecure)");
        return null;
    }

    /** Whether {@code host} names this machine only; a name other than localhost is never looked up. */
    public static boolean isLoopback(String host) {
        String h = host.toLowerCase(Locale.ROOT);
        if (h.equals("localhost") || h.equals("localhost.")) return true;
        boolean v6 = h.startsWith("[") && h.endsWith("]");
        if (!v6 && !IPV4.matcher(h).matches()) return false;   // a name: resolving it could say anything
        try {
            return InetAddress.getByName(v6 ? h.substring(1, h.length() - 1) : h).isLoopbackAddress();  // a literal
        } catch (IOException e) {
            return false;
        }
    }

    /** Trust exactly the certificates in {@code caFile} (PEM, one or more), or the platform's CAs if null. */
    static Tls trusting(Path caFile) {
        try {
            KeyStore store = null;
            if (caFile != null) {
                Collection<? extends Certificate> certs;
                try (InputStream in = Files.newInputStream(caFile)) {
                    certs = CertificateFactory.getInstance("X.509").generateCertificates(in);
                } catch (IOException e) {
                    throw new IllegalArgumentException("cannot read the CA file " + caFile + ": " + e);
                } catch (CertificateException e) {
                    throw new IllegalArgumentException("the CA file " + caFile + " is not PEM certificates: " + e.getMessage());
                }
                if (certs.isEmpty()) throw new IllegalArgumentException("the CA file " + caFile + " holds no certificate");
                store = KeyStore.getInstance(KeyStore.getDefaultType());
                store.load(null, null);
                int n = 0;
                for (Certificate cert : certs) store.setCertificateEntry("ca-" + n++, cert);
            }
            TrustManagerFactory factory = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
            factory.init(store);   // null: the platform's CAs
            X509TrustManager trust = null;
            for (TrustManager m : factory.getTrustManagers()) if (m instanceof X509TrustManager) trust = (X509TrustManager) m;
            if (trust == null) throw new IllegalStateException("no X.509 trust manager on this platform");
            SSLContext context = SSLContext.getInstance("TLS");
            context.init(null, new TrustManager[] {trust}, null);
            return new Tls(context, trust);
        } catch (GeneralSecurityException | IOException e) {
            throw new IllegalStateException("cannot set up TLS: " + e, e);
        }
    }

    /**
     * The certificate problem behind a failed connection (unknown issuer, wrong host name, expired...), or null if
     * the failure was something else. A certificate problem is not fixed by retrying.
     */
    public static String certificateProblem(Throwable error) {
        for (Throwable t = error; t != null; t = t.getCause()) {
            if (t instanceof CertificateException) return String.valueOf(t.getMessage());
        }
        return null;
    }
}
