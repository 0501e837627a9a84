package org.splitface.core;

import java.nio.file.Files;
import java.nio.file.Path;

/**
 * A .pte program through ExecuTorch's C++ runtime (libsplitface_jni, built from
 * splitface/device/runtimes/native/splitface_jni.cpp with the runner): XNNPACK, the optimized kernels, no Python and
 * no PyTorch in the process. Inputs are checked against the program's shapes in C++ before it runs; a mismatch
 * throws {@link IllegalArgumentException} naming the input. One call at a time (the runtime's method and its
 * buffers are not reentrant), and {@link #close} waits for a call in progress.
 */
public final class NativeProgram implements Program {
    private long handle;

    /** Loads the JNI library once per JVM (System.load: an absolute path). */
    public static synchronized void loadLibrary(Path library) {
        if (!Files.isRegularFile(library))
            throw new IllegalArgumentException("no JNI library at " + library + ": it is built with the native "
                    + "runner (splitface.device.runtimes.native.jni_library(); needs a JDK's jni.h, cmake and g++)");
        System.load(library.toAbsolutePath().toString());
    }

    /** One thread (XNNPACK on the calling thread, as the runner's --threads 1) or the runtime's pool (one per core). */
    public static void singleThreaded(boolean on) { setSingleThread(on); }

    public NativeProgram(Path pte) {
        if (!Files.isRegularFile(pte)) throw new IllegalArgumentException("no program at " + pte);
        handle = load(pte.toAbsolutePath().toString());
    }

    @Override public synchronized long[] inputShape(int index) { return inputShape(live(), index); }

    public synchronized int inputCount() { return inputCount(live()); }

    @Override public synchronized float[][] forward(float[][] inputs) { return forward(live(), inputs); }

    @Override public synchronized void close() {
        if (handle != 0) free(handle);
        handle = 0;
    }

    private long live() {
        if (handle == 0) throw new IllegalStateException("the program is closed");
        return handle;
    }

    private static native long load(String path);
    private static native int inputCount(long handle);
    private static native long[] inputShape(long handle, int index);
    private static native float[][] forward(long handle, float[][] inputs);
    private static native void free(long handle);
    private static native void setSingleThread(boolean on);
}
