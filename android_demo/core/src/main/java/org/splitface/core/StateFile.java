package org.splitface.core;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.ByteBuffer;
import java.nio.channels.FileChannel;
import java.nio.file.AtomicMoveNotSupportedException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.nio.file.StandardOpenOption;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.regex.Pattern;

/**
 * A device's durable state file (as splitface/device/privacy/state.py): msgpack {format, version, sha256, state}, written
 * whole (temp file, fsync, atomic rename, fsync of the folder) so that after a crash it is the old state or the new
 * one, and read back only if its format, version and SHA-256 check. A file that fails is an error, never a reason
 * to start afresh: the budget guard would spend again, the training state would replay applied batches.
 */
final class StateFile {
    private StateFile() {}

    static final long VERSION = 1;
    // A device id becomes a file name: no path separators, no leading dot (as splitface/device/privacy/state.py).
    private static final Pattern SAFE_ID = Pattern.compile("^[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}$");

    /** The file {@code <dir>/<device id>.<kind>.msgpack}; the device id must be a safe file name. */
    static Path path(Path dir, String deviceId, String kind) {
        if (!SAFE_ID.matcher(deviceId).matches())
            throw new IllegalArgumentException("device id '" + deviceId + "' cannot name a state file (letters, digits and _ . @ + - only)");
        return dir.resolve(deviceId + "." + kind + ".msgpack");
    }

    static String hex(byte[] bytes) {   // not HexFormat: older Android releases lack it
        StringBuilder out = new StringBuilder(bytes.length * 2);
        for (byte b : bytes) out.append(Character.forDigit((b >> 4) & 15, 16)).append(Character.forDigit(b & 15, 16));
        return out.toString();
    }

    private static byte[] sha256(byte[] data) {
        try {
            return MessageDigest.getInstance("SHA-256").digest(data);
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }

    /** Write {@code state} (msgpack bytes) atomically in its checksummed envelope; {@code what} names it in errors. */
    static void write(Path file, String format, byte[] state, String what) {
        Map<String, Object> envelope = new LinkedHashMap<>();
        envelope.put("format", format);
        envelope.put("version", VERSION);
        envelope.put("sha256", hex(sha256(state)));
        envelope.put("state", state);
        Path dir = file.toAbsolutePath().getParent();
        Path tmp = dir.resolve("." + file.getFileName() + ".tmp");
        try {
            Files.createDirectories(dir);
            try (FileChannel ch = FileChannel.open(tmp, StandardOpenOption.CREATE, StandardOpenOption.WRITE,
                    StandardOpenOption.TRUNCATE_EXISTING)) {
                ByteBuffer buf = ByteBuffer.wrap(Wire.pack(envelope));
                while (buf.hasRemaining()) ch.write(buf);
                ch.force(true);
            }
            try {
                Files.move(tmp, file, StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING);
            } catch (AtomicMoveNotSupportedException e) {
                throw new IOException("this file system cannot rename " + tmp + " atomically", e);
            }
            try (FileChannel folder = FileChannel.open(dir, StandardOpenOption.READ)) {
                folder.force(true);   // the rename itself is durable (Linux and Android allow fsync of a directory)
            }
        } catch (IOException e) {
            try { Files.deleteIfExists(tmp); } catch (IOException ignored) { /* the write already failed */ }
            throw new UncheckedIOException("cannot save the " + what + " to " + file + "; nothing was released", e);
        }
    }

    /** The state bytes of a file {@link #write} wrote with this format; BudgetGuard.StateFileError for anything else. */
    @SuppressWarnings("unchecked")
    static byte[] read(Path file, String format, String what) {
        Object envelope;
        try {
            envelope = Wire.unpack(Files.readAllBytes(file));
        } catch (IOException | ProtocolException e) {
            throw new BudgetGuard.StateFileError(file + ": " + what + " unreadable or corrupt (" + e.getMessage() + "); refusing to "
                    + "release (restore the file or retire this device id, never delete it to reset)");
        }
        if (!(envelope instanceof Map) || !format.equals(((Map<?, ?>) envelope).get("format")))
            throw new BudgetGuard.StateFileError(file + ": not a " + what + " file");
        Map<String, Object> env = (Map<String, Object>) envelope;
        if (!Long.valueOf(VERSION).equals(env.get("version")))
            throw new BudgetGuard.StateFileError(file + ": " + what + " version " + env.get("version") + ", this device reads " + VERSION);
        if (!(env.get("state") instanceof byte[]) || !hex(sha256((byte[]) env.get("state"))).equals(env.get("sha256")))
            throw new BudgetGuard.StateFileError(file + ": " + what + " fails its checksum (corrupt or edited); refusing to release");
        return (byte[]) env.get("state");
    }
}
