package org.splitface.demo;

import android.app.Activity;
import android.os.Bundle;
import android.widget.Button;
import android.widget.EditText;
import android.widget.TextView;
import java.io.File;
import org.splitface.core.AppBundle;
import org.splitface.core.AppRun;
import org.splitface.core.BudgetGuard;
import org.splitface.core.EnergyMeter;
import org.splitface.core.Messages;
import org.splitface.core.RemoteError;
import org.splitface.core.Tls;
import org.splitface.core.UntrustedServer;

/**
 * Start/stop a training run against an edge server and show each batch's device latency and energy. Only the
 * Android glue is here (views, the photo decoder, BatteryManager, OkHttp, the JNI library's loading); the run is the
 * core's {@link AppRun} on the folder of `splitface-export --app` in the app's external files dir (`bundle/`), with
 * photos in `faces/<class name>/` and an optional `ca.pem`: see android_demo/README.md.
 */
public class MainActivity extends Activity {
    private volatile boolean running;
    private TextView status, batches;

    @Override protected void onCreate(Bundle state) {
        super.onCreate(state);
        setContentView(R.layout.activity_main);
        status = findViewById(R.id.status);
        batches = findViewById(R.id.batches);
        Button button = findViewById(R.id.start_stop);
        button.setOnClickListener(v -> {
            if (running) { running = false; button.setText("Start"); return; }
            running = true;
            button.setText("Stop");
            String url = ((EditText) findViewById(R.id.url)).getText().toString();
            String id = ((EditText) findViewById(R.id.device_id)).getText().toString();
            String token = ((EditText) findViewById(R.id.token)).getText().toString();
            new Thread(() -> train(url, id, token), "splitface-training").start();
        });
    }

    private void show(TextView view, String text, boolean append) {
        runOnUiThread(() -> { if (append) view.append(text + "\n"); else view.setText(text); });
    }

    private void train(String typedUrl, String deviceId, String token) {
        File root = getExternalFilesDir(null);
        try {
            System.loadLibrary("splitface_jni");   // jniLibs/arm64-v8a/libsplitface_jni.so (README: built with the NDK)
            AppBundle bundle = AppBundle.load(new File(root, "bundle").toPath());
            if (bundle.classes == null) throw new AppBundle.Invalid("the job names no classes: export with --classes");
            String url = bundle.url(typedUrl);
            File ca = new File(root, "ca.pem");   // the CA that signed the server's certificate (wss://)
            Tls tls = Tls.forUrl(url, ca.exists() ? ca.toPath() : null, false);
            try (EnergyMeter meter = new EnergyMeter(new AndroidBattery(this), 200);
                 AppRun run = new AppRun(bundle, new FaceFolder(new File(root, "faces"), bundle.classes), true, url,
                         deviceId, token, OkHttpTransport.factory(tls), getFilesDir().toPath(), meter,
                         Messages.DEFAULT_MAX_MESSAGE_BYTES)) {
                run.connect();
                while (running && !run.done()) {
                    AppRun.Batch batch = run.next();
                    if (batch == null) continue;   // the server resumed from an older checkpoint: rolled back
                    show(batches, batch.describe(), true);
                    show(status, "batch " + run.committed() + " of " + run.total(), false);
                }
                show(status, run.done() ? "done: " + run.total() + " batches" : "stopped", false);
            }
        } catch (RemoteError e) {
            show(status, "The server refused: " + e.detail + " (" + e.code + ")", false);
        } catch (UntrustedServer e) {
            show(status, "Not connecting: " + e.getMessage(), false);
        } catch (BudgetGuard.BudgetExceeded e) {
            show(status, "Privacy budget spent; nothing more was sent. " + e.getMessage(), false);
        } catch (BudgetGuard.LostState | BudgetGuard.StateFileError e) {
            show(status, "Privacy state cannot be trusted; nothing was sent. " + e.getMessage(), false);
        } catch (AppBundle.Invalid e) {
            show(status, "The exported folder cannot be used: " + e.getMessage(), false);
        } catch (Throwable e) {
            show(status, "Stopped: " + e, false);
        } finally {
            running = false;
        }
    }
}
