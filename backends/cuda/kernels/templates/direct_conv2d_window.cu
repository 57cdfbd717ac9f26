    float best[$COT];
#pragma unroll
    for (int j = 0; j < $COT; ++j) best[j] = $best_init;
    for (int ph = 0; ph < $PKH; ++ph) {
      const int ch = oh * $PSH - $PPH + ph;
      if (ch < 0 || ch >= CH) continue;
      for (int pw = 0; pw < $PKW; ++pw) {
        const int cw = ow * $PSW - $PPW + pw;
        if (cw < 0 || cw >= CW) continue;
        float sum[$COT];
#pragma unroll
        for (int j = 0; j < $COT; ++j) sum[j] = 0.f;
        const int hs = ch * $SH - $PH, wsx = cw * $SW - $PW;
$loops
$reduce_window
#pragma unroll
        for (int j = 0; j < $COT; ++j) {
          const int co = co0 + j;
          if (co >= $CO) break;
          float acc = sum[j];
$epilogue
          $combine
        }
      }
    }
